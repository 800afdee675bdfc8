"""trainmem: how much GPU memory training a transformer takes, and why, from Python.

The same C++ core as the ``trainmem`` command: every keyword is a field of the CLI's request (``batch=8`` is
``--batch 8``, ``optimizer_impl="fused"`` is ``--optimizer-impl fused``), parsed by the library, and every result
is the document ``trainmem <command> --format json`` prints, as Python objects. The numbers cannot differ.

    >>> import trainmem
    >>> e = trainmem.estimate(model="gpt2", batch=8, seq=1024, gpu="rtx-4090")
    >>> e.peak_allocated_bytes, e.fits
    (13258217984, True)

See docs/python.md.
"""

import array
import json
import warnings as _warnings

from . import _core
from ._core import Error

__all__ = [
    "Error", "TrainmemWarning", "Scenario", "estimate", "fit", "plan", "params", "gpus", "fields",
    "Estimate", "Fit", "Plan", "Params", "Timeline", "Component", "Verdict", "Section",
]

# trainmem.Error: bad input, with the CLI's message (what `trainmem` prints after "trainmem: "). `field` names
# the scenario field at fault ("batch") where there is one, and `detail` is the message after the field's flag.
__version__ = _core.version

Error.__module__ = __name__
Error.field = None
Error.detail = None


class TrainmemWarning(UserWarning):
    """What the CLI prints as "trainmem: warning: ...": a default taken, a slower kernel on this card."""


def _say(warnings):
    for w in warnings:
        _warnings.warn(w, TrainmemWarning, stacklevel=3)


# --- Keywords -> fields ---------------------------------------------------------------------------------------

def _text(name, value):
    """A keyword's value as the field's text (what the CLI's flag would be given)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return value if isinstance(value, str) else repr(value)
    raise Error(f'{_core.cli_flag(name)}: expected a str, int, float or bool, not {type(value).__name__} '
                f'({value!r})')


_FIELDS = {name: repeatable for name, _help, _group, repeatable, _default in _core.fields()}


def _field_pairs(kwargs):
    """[(field, text)] from keywords; None leaves a field out (its default). A repeatable field (overrides,
    freeze) takes a str or a list of them; overrides also a dict {key: value} of config keys."""
    pairs = []
    for name, value in kwargs.items():
        if value is None:
            continue
        if _FIELDS.get(name):
            if isinstance(value, dict):
                value = [f"{k}={_text(name, v)}" for k, v in value.items()]
            elif isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                value = [value]
            pairs.extend((name, _text(name, v)) for v in value)
        else:
            pairs.append((name, _text(name, value)))
    return pairs


def _config_text(config):
    """(path, config.json text) of a dict of config.json keys or an object with to_dict() (a transformers
    PretrainedConfig). The path is the model field's value: the config's _name_or_path/config.json, or
    config.json; it is never a preset name, so the given config is what is read."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise Error(f"config: expected a dict of config.json keys or an object with to_dict() (a transformers "
                    f"PretrainedConfig), not {type(config).__name__}")
    # default=str: to_dict() may hold values json cannot write (a torch.dtype); the reader names what it rejects
    text = json.dumps(config, default=str)
    name = config.get("_name_or_path") or ""
    path = f"{name.rstrip('/')}/config.json" if isinstance(name, str) and name else "config.json"
    return path, text


class Scenario:
    """One question: the model, how it is trained, the runtime. Built from keywords (the CLI's fields by
    name), optionally from a config (a dict of config.json keys, or a transformers PretrainedConfig or anything
    with to_dict()) instead of a model= preset or path. Values are checked when it is built (trainmem.Error)."""

    def __init__(self, config=None, **fields):
        if config is not None and fields.get("model") is not None:
            raise Error("config and model: give one (model= is a preset name or a config.json path, config= its "
                        "keys)")
        self._kwargs = dict(fields)
        self._config = None if config is None else _config_text(config)
        self._pairs = _field_pairs(fields)
        if self._config is not None:
            self._pairs.insert(0, ("model", self._config[0]))
        _core.check(self._pairs)

    @classmethod
    def from_config(cls, config, **fields):
        """A Scenario of a config (dict, or an object with to_dict()) and the other fields as keywords."""
        return cls(config=config, **fields)

    def replace(self, **fields):
        """A copy with these fields changed (None: back to the default)."""
        kwargs = {**self._kwargs, **fields}
        s = Scenario.__new__(Scenario)
        s._kwargs = kwargs
        s._config = self._config
        s._pairs = _field_pairs(kwargs)
        if s._config is not None:
            s._pairs.insert(0, ("model", s._config[0]))
        _core.check(s._pairs)
        return s

    @property
    def given(self):
        """The fields given, as {field: text or [texts]}: what the CLI's flags would be."""
        out = {}
        for name, text in self._pairs:
            if _FIELDS.get(name):
                out.setdefault(name, []).append(text)
            else:
                out[name] = text
        return out

    def fields(self):
        """Every (non-repeatable) field with its text, defaults included, as the library reads it back."""
        return dict(_core.field_texts(self._pairs))

    def cli_args(self):
        """The CLI's flags for this scenario (a config given as keys needs its config.json written first)."""
        return [w for name, text in self._pairs for w in (_core.cli_flag(name), text)]

    def estimate(self):
        """trainmem estimate: see trainmem.estimate."""
        r = _core.estimate(self._pairs, self._config)
        _say(r.warnings)
        return Estimate(r)

    def fit(self, solve="batch", margin="5%"):
        """trainmem fit: see trainmem.fit."""
        text, warns = _core.fit(self._pairs, self._config, str(solve), _text("margin", margin))
        _say(warns)
        return Fit(json.loads(text), warns)

    def plan(self, global_batch, nodes=None, top=10, margin="5%"):
        """trainmem plan: see trainmem.plan."""
        text, warns = _core.plan(self._pairs, self._config, _text("global_batch", global_batch),
                                 "" if nodes is None else _text("nodes", nodes), _text("top", top),
                                 _text("margin", margin))
        _say(warns)
        return Plan(json.loads(text), warns)

    def params(self, dtype="float32"):
        """trainmem params: see trainmem.params."""
        text, warns = _core.params(self._pairs, self._config, str(dtype))
        _say(warns)
        return Params(json.loads(text), warns)

    def __repr__(self):
        args = [f"config=<{self._config[0]}>"] if self._config else []
        args += [f"{k}={v!r}" for k, v in self._kwargs.items() if v is not None]
        return f"trainmem.Scenario({', '.join(args)})"


def _scenario(scenario, config, fields):
    if isinstance(scenario, str):  # estimate("gpt2", batch=8): the model
        scenario, fields = None, {"model": scenario, **fields}
    if scenario is None:
        return Scenario(config=config, **fields)
    if config is not None or fields:
        scenario = scenario.replace(**fields) if config is None else Scenario(config=config, **{
            **scenario._kwargs, **fields})
    return scenario


def estimate(scenario=None, *, config=None, **fields):
    """The memory of one training step (or inference pass), as `trainmem estimate --format json`: an Estimate.
    Keywords are the CLI's fields (model, batch, seq, precision, optimizer, lora, quantize, gpu, gpus, ...)."""
    return _scenario(scenario, config, fields).estimate()


def fit(scenario=None, *, config=None, solve="batch", margin="5%", **fields):
    """The largest micro-batch (solve="batch") or sequence (solve="seq") whose step fits the GPU, keeping
    `margin` free ("5%", "2GiB"), as `trainmem fit --format json`: a Fit. Needs gpu= or gpus=."""
    return _scenario(scenario, config, fields).fit(solve=solve, margin=margin)


def plan(scenario=None, *, config=None, global_batch, nodes=None, top=10, margin="5%", **fields):
    """The fastest setups that fit a cluster (gpus="64xh100-80gb"), as `trainmem plan --format json`: a Plan, whose
    rows are ranked by predicted tokens/s and whose families say why each other setup has no row. Fields given
    (tp=8, checkpointing="full") are kept in every setup."""
    return _scenario(scenario, config, fields).plan(global_batch, nodes=nodes, top=top, margin=margin)


def params(scenario=None, *, config=None, dtype="float32", **fields):
    """Every parameter and buffer of the model, as `trainmem params --format json`: a Params."""
    return _scenario(scenario, config, fields).params(dtype=dtype)


def gpus():
    """The GPU catalog (`trainmem gpus --format json`): a list of Sections."""
    return [Section(g) for g in json.loads(_core.gpus())]


def fields():
    """The scenario's fields: {name: {"help", "group", "repeatable", "default"}}, in the CLI's order."""
    return {name: {"help": h, "group": g, "repeatable": r, "default": d} for name, h, g, r, d in _core.fields()}


# --- Results ---------------------------------------------------------------------------------------------------

def _wrap(v):
    if isinstance(v, dict):
        return Section(v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


class Section:
    """A part of a JSON result with its keys as attributes (ints for bytes and counts, str, bool, None, nested
    Sections and lists). `to_dict()` gives the JSON back."""

    __slots__ = ("_d",)

    def __init__(self, d):
        object.__setattr__(self, "_d", d)

    def __getattr__(self, key):
        try:
            return _wrap(self._d[key])
        except KeyError:
            raise AttributeError(key) from None

    def __getitem__(self, key):
        return _wrap(self._d[key])

    def __contains__(self, key):
        return key in self._d

    def __setattr__(self, key, value):
        raise AttributeError("trainmem results are read-only")

    def keys(self):
        return self._d.keys()

    def get(self, key, default=None):
        return _wrap(self._d.get(key, default))

    def to_dict(self):
        return self._d

    def __eq__(self, other):
        return isinstance(other, Section) and other._d == self._d

    def __dir__(self):
        return list(self._d.keys())

    def __repr__(self):
        return f"Section({self._d!r})"


class Component:
    """One line of the breakdown at the peak: name, bytes, note (what it is)."""

    __slots__ = ("name", "bytes", "note")

    def __init__(self, name, bytes, note):
        self.name, self.bytes, self.note = name, bytes, note

    def __repr__(self):
        return f"Component(name={self.name!r}, bytes={self.bytes}, note={self.note!r})"


class Verdict(Section):
    """Whether the step fits the GPU (the estimate's "device" section): fits, name, capacity_bytes,
    usable_bytes, headroom_bytes, peak_reserved_bytes, nvidia_smi_bytes, and oom when it does not fit."""

    __slots__ = ()

    def __repr__(self):
        d = self._d
        return (f"Verdict(name={d.get('name')!r}, fits={d.get('fits')}, headroom_bytes={d.get('headroom_bytes')}, "
                f"usable_bytes={d.get('usable_bytes')})")


class Estimate:
    """`trainmem estimate --format json` as objects. Sections: model, setup, parameters, memory (every byte
    figure), and, where the setup has them, ddp, zero, fsdp, pp, ranks, tp, ep, host, generation, time (the step
    time on a GPU whose peaks are catalogued; see `json`).
    Shortcuts: peak_allocated_bytes, peak_reserved_bytes, steady_state_bytes, ... (memory's), breakdown (the
    components at the peak), verdict (with a GPU) and fits. timeline() lists the step as arrays."""

    def __init__(self, result):
        self._result = result
        self.json = json.loads(result.json())  # the CLI's document
        self.warnings = list(result.warnings)
        self.memory = Section(self.json["memory"])
        self.breakdown = [Component(c["name"], c["bytes"], c["note"]) for c in self.json["peak_components"]]
        self.verdict = Verdict(self.json["device"]) if "device" in self.json else None

    def __getattr__(self, key):
        # every other section of the document (model, setup, parameters, ddp, zero, ...): None when absent
        if key.startswith("_"):
            raise AttributeError(key)
        d = self.__dict__.get("json", {})
        if key in d:
            return _wrap(d[key])
        if key in ("ddp", "zero", "fsdp", "pp", "ranks", "tp", "ep", "host", "generation", "device", "time"):
            return None
        raise AttributeError(key)

    # memory figures (memory.<name>)
    peak_allocated_bytes = property(lambda self: self.json["memory"]["peak_allocated_bytes"],
                                    doc="torch.cuda.max_memory_allocated() of the step")
    peak_reserved_bytes = property(lambda self: self.json["memory"]["peak_reserved_bytes"],
                                   doc="torch.cuda.max_memory_reserved() (on the GPU, when one is given)")
    steady_state_bytes = property(lambda self: self.json["memory"]["steady_state_bytes"],
                                  doc="memory_allocated() before the last simulated step's forward")
    steady_state_reserved_bytes = property(lambda self: self.json["memory"]["steady_state_reserved_bytes"])
    live_tensors_at_peak_bytes = property(lambda self: self.json["memory"]["live_tensors_at_peak_bytes"])
    saved_activations_bytes = property(lambda self: self.json["memory"]["saved_activations_bytes"])
    fragmentation_bytes = property(lambda self: self.json["memory"]["fragmentation_bytes"])
    device_total_bytes = property(lambda self: self.json["memory"].get("device_total_bytes"),
                                  doc="what nvidia-smi would show (with a GPU; None without)")
    fits = property(lambda self: self.verdict.fits if self.verdict is not None else None,
                    doc="whether the step fits the GPU (None without one)")

    def timeline(self, by="layer", min_bytes=0, step=None):
        """The step as `trainmem timeline --by <by> --format json` lists it, as a Timeline of columns:
        by "event" (every allocation and free), "layer" or "phase"; min_bytes (event rows of at least this
        size: 4096, "1MiB"); step (only this optimizer step; 0: the model load)."""
        text = self._result.timeline_json(str(by), _text("min_bytes", min_bytes),
                                          "" if step is None else _text("step", step))
        return Timeline(json.loads(text))

    def breakdown_svg(self):
        """The breakdown at the peak (against the card with a GPU) as an SVG document: `trainmem estimate
        --plot`'s picture. In a notebook: IPython.display.SVG(e.breakdown_svg())."""
        return self._result.breakdown_svg()

    def timeline_svg(self, step=None):
        """The step like memory_viz's active memory timeline, as an SVG document: `trainmem timeline [--step N]
        --plot`'s picture (live bytes by category, allocated and reserved, the phases, the peak's tensors)."""
        return self._result.timeline_svg("" if step is None else _text("step", step))

    def __repr__(self):
        m = self.json["memory"]
        gpu = f", fits={self.fits}" if self.verdict is not None else ""
        return (f"trainmem.Estimate(model={self.json['model']['name']!r}, "
                f"peak_allocated_bytes={m['peak_allocated_bytes']}, peak_reserved_bytes={m['peak_reserved_bytes']}"
                f"{gpu})")


def _column(values):
    """A column of the timeline: array.array('Q') of non-negative integers, 'q' with negative ones (layer -1),
    a dict of columns for dict rows (live bytes by category), else a list (names, phases, flags)."""
    if values and all(isinstance(v, dict) for v in values):
        return {k: _column([v.get(k) for v in values]) for k in values[0]}
    if values and all(type(v) is int for v in values):
        return array.array("q" if min(values) < 0 else "Q", values)
    return list(values)


class Timeline:
    """`trainmem timeline --format json` as columns: one entry per row, each column an array.array of
    integers (buffer protocol: numpy.asarray and matplotlib take it as is) or a list; live_bytes is a dict of
    such columns by category. Columns: first_event, last_event, step, micro_batch, phase, layer, events,
    live_bytes, live_total_bytes, max_live_bytes, allocated_bytes, max_allocated_bytes, reserved_bytes,
    max_reserved_bytes, peak_live, peak_allocated, peak_reserved, oom; by event also kind, category,
    from_category, tensor, bytes, block_bytes; by layer or phase largest_tensor and largest_tensor_bytes.
    The rest of the document (granularity, events_total, peak, device, ...) is in `json` and as attributes."""

    def __init__(self, doc):
        rows = doc.pop("rows")
        self.json = doc
        keys = []
        for r in rows:
            keys.extend(k for k in r if k not in keys)
        self.columns = {k: _column([r.get(k) for r in rows]) for k in keys}
        self.rows = len(rows)

    def __len__(self):
        return self.rows

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        cols = self.__dict__.get("columns", {})
        if key in cols:
            return cols[key]
        doc = self.__dict__.get("json", {})
        if key in doc:
            return _wrap(doc[key])
        raise AttributeError(key)

    def __repr__(self):
        return (f"trainmem.Timeline(granularity={self.json.get('granularity')!r}, rows={self.rows}, "
                f"events_total={self.json.get('events_total')})")


class _Document(Section):
    """A whole JSON result (`json`), with the warnings the CLI prints for it."""

    __slots__ = ("warnings",)

    def __init__(self, d, warnings):
        super().__init__(d)
        object.__setattr__(self, "warnings", list(warnings))

    @property
    def json(self):
        return self._d


class Fit(_Document):
    """`trainmem fit --format json` as attributes: largest (None: even 1 does not fit), fits, solve, gpu,
    limit_bytes, margin_bytes, probes (every size simulated), suggestions (changes that save memory or raise
    the answer), sharding ladder, ... `warnings` as the CLI prints them."""

    __slots__ = ()

    def __repr__(self):
        gpu = (self._d.get('gpu') or {}).get('name')
        return f"trainmem.Fit(solve={self._d.get('solve')!r}, largest={self._d.get('largest')}, gpu={gpu!r})"


class Plan(_Document):
    """`trainmem plan --format json` as attributes: rows (fastest first, each with its fields, memory and time),
    best_reason, families (each with its verdict and why), simulations, notes. `warnings` as the CLI prints them."""

    __slots__ = ()

    def __repr__(self):
        best = self._d["rows"][0]["family"] if self._d.get("rows") else None
        return f"trainmem.Plan(model={self._d.get('model')!r}, gpus={self._d.get('gpus')}, best={best!r})"


class Params(_Document):
    """`trainmem params --format json` as attributes: model, dtype, parameters and buffers (each tensor: name,
    shape, elements, dtype, bytes) and totals (parameter_count, parameter_bytes, trainable_count, ...)."""

    __slots__ = ()

    count = property(lambda self: self._d["totals"]["parameter_count"], doc="parameters (elements)")
    trainable = property(lambda self: self._d["totals"]["trainable_count"])

    def __repr__(self):
        return (f"trainmem.Params(model={self._d['model']['name']!r}, parameter_count={self.count}, "
                f"tensors={len(self._d['parameters']) + len(self._d['buffers'])})")
