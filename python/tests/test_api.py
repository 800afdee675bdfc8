# The Python API: estimate, fit, params, Scenario (keywords, dict, config object), the timeline's arrays and the
# verdict, each returning typed results.
import array
import warnings

import pytest
import trainmem

from conftest import preset_config


def test_estimate_returns_memory_figures_as_integers():
    e = trainmem.estimate(model="gpt2", batch=2, seq=256)
    for figure in (e.peak_allocated_bytes, e.peak_reserved_bytes, e.steady_state_bytes,
                   e.steady_state_reserved_bytes, e.live_tensors_at_peak_bytes, e.saved_activations_bytes,
                   e.fragmentation_bytes):
        assert type(figure) is int and figure > 0
    assert e.peak_reserved_bytes >= e.peak_allocated_bytes >= e.steady_state_bytes
    assert e.memory.peak_allocated_bytes == e.peak_allocated_bytes
    assert e.model.name == "gpt2" and e.setup.batch == 2 and e.setup.seq == 256
    assert e.parameters.count == 124439808  # GPT-2 small's published 124M (trainmem models)


def test_breakdown_components_sum_to_the_live_tensors_at_the_peak():
    e = trainmem.estimate(model="gpt2", batch=2, seq=256)
    assert e.breakdown and all(isinstance(c, trainmem.Component) for c in e.breakdown)
    assert {"weights", "activations"} <= {c.name for c in e.breakdown}
    assert sum(c.bytes for c in e.breakdown) == e.live_tensors_at_peak_bytes


def test_without_a_gpu_there_is_no_verdict():
    e = trainmem.estimate(model="gpt2", batch=2, seq=256)
    assert e.verdict is None and e.fits is None and e.device_total_bytes is None


def test_verdict_says_the_step_fits_a_large_gpu_and_not_a_small_one():
    big = trainmem.estimate(model="gpt2", batch=2, seq=256, gpu="a100-80gb")
    assert isinstance(big.verdict, trainmem.Verdict)
    assert big.fits is True and big.verdict.headroom_bytes > 0 and big.verdict.name == "a100-80gb"
    assert big.device_total_bytes == big.verdict.nvidia_smi_bytes
    small = trainmem.estimate(model="gpt2", batch=32, seq=1024, gpu="4GiB")
    assert small.fits is False and small.verdict.headroom_bytes < 0
    assert small.verdict.oom.tensor


def test_timeline_by_event_has_one_array_entry_per_event():
    e = trainmem.estimate(model="gpt2", batch=1, seq=64)
    t = e.timeline(by="event")
    assert len(t) == t.events_total > 0
    assert isinstance(t.allocated_bytes, array.array) and t.allocated_bytes.typecode == "Q"
    assert isinstance(t.layer, array.array) and t.layer.typecode == "q"  # -1: no layer
    assert len(memoryview(t.reserved_bytes)) == len(t)                 # buffer protocol
    assert max(t.allocated_bytes) == e.peak_allocated_bytes
    assert max(t.reserved_bytes) == e.peak_reserved_bytes
    assert max(t.live_total_bytes) == e.live_tensors_at_peak_bytes
    assert set(t.phase) >= {"setup", "forward", "backward", "optimizer step"}
    assert set(t.kind) >= {"alloc", "free"} and len(t.tensor) == len(t)
    weights = t.live_bytes["weights"]
    assert isinstance(weights, array.array) and len(weights) == len(t)


def test_timeline_by_phase_marks_the_peaks():
    e = trainmem.estimate(model="gpt2", batch=1, seq=64)
    assert set(e.timeline(by="phase", step=2).columns["step"]) == {2}
    t = e.timeline(by="phase")
    assert t.granularity == "phase" and t.json["step"] is None  # the document's step; t.step is the column
    assert t.peak_allocated.count(True) == 1
    i = t.peak_allocated.index(True)
    assert t.max_allocated_bytes[i] == e.peak_allocated_bytes


def test_timeline_min_bytes_keeps_only_large_tensors():
    e = trainmem.estimate(model="gpt2", batch=1, seq=64)
    t = e.timeline(by="event", min_bytes="1MiB")
    assert len(t) > 0 and min(t.bytes) >= 1 << 20


def test_fit_finds_the_largest_batch_that_fits():
    f = trainmem.fit(model="gpt2", seq=512, gpu="rtx-4090")
    assert isinstance(f, trainmem.Fit) and f.fits is True and type(f.largest) is int and f.largest > 1
    fits = [p for p in f.probes if p.fits]
    assert max(p.batch for p in fits) == f.largest
    at = trainmem.estimate(model="gpt2", seq=512, batch=f.largest, gpu="rtx-4090")
    assert at.fits is True


def test_fit_solves_for_the_sequence():
    f = trainmem.fit(model="gpt2", batch=4, gpu="rtx-4090", solve="seq", margin="2GiB")
    assert f.solve == "seq" and f.largest >= 1024 and f.margin_bytes == 2 << 30


def test_params_lists_every_tensor():
    p = trainmem.params(model="gpt2")
    assert isinstance(p, trainmem.Params)
    assert p.count == 124439808 == sum(t.elements for t in p.parameters)
    assert p.parameters[0].name == "transformer.wte.weight" and p.parameters[0].shape == [50257, 768]
    half = trainmem.params(model="gpt2", dtype="bfloat16")
    assert half.totals.parameter_bytes * 2 == p.totals.parameter_bytes


def test_params_of_a_model_with_a_short_position_table():
    # bert's 512 positions: the listing must not be refused by the training default of 1,024 tokens
    assert trainmem.params(model="bert-base-uncased").count > 0


def test_scenario_from_keywords_gives_the_same_estimate():
    s = trainmem.Scenario(model="gpt2", batch=2, seq=256, precision="fp32", optimizer="sgd")
    assert s.estimate().json == trainmem.estimate(model="gpt2", batch=2, seq=256, precision="fp32",
                                                  optimizer="sgd").json
    assert s.given == {"model": "gpt2", "batch": "2", "seq": "256", "precision": "fp32", "optimizer": "sgd"}
    assert s.cli_args()[:4] == ["--model", "gpt2", "--batch", "2"]


def test_scenario_fields_read_back_with_defaults():
    f = trainmem.Scenario(model="gpt2", batch=3, checkpoint_reentrant=True).fields()
    assert f["batch"] == "3" and f["checkpoint_reentrant"] == "true"
    assert f["seq"] == trainmem.fields()["seq"]["default"] == "1024"


def test_python_values_become_the_fields_text():
    # True/False -> true/false, ints -> digits, a list or a dict for a repeatable field
    s = trainmem.Scenario(model="gpt2", checkpointing="full", checkpoint_reentrant=False, batch=2, seq=128,
                          overrides={"n_layer": 2}, freeze=["transformer.wte.*", "transformer.wpe.*"])
    assert s.given["checkpoint_reentrant"] == "false"
    assert s.given["overrides"] == ["n_layer=2"]
    e = s.estimate()
    assert e.parameters.trainable < e.parameters.count
    two = trainmem.estimate(model="gpt2", batch=2, seq=128, overrides="n_layer=2")
    assert two.parameters.count == e.parameters.count


def test_keyword_order_does_not_change_the_scenario():
    # lora resets the adapters' dtype: applied in the field table's order, as the CLI applies its flags
    a = trainmem.estimate(model="gpt2", batch=1, seq=64, lora_dtype="base", lora="r=8", precision="bf16")
    b = trainmem.estimate(model="gpt2", batch=1, seq=64, lora="r=8", lora_dtype="base", precision="bf16")
    assert a.json == b.json


def test_none_leaves_a_field_at_its_default():
    assert trainmem.estimate(model="gpt2", batch=1, seq=64, gpu=None).json == \
        trainmem.estimate(model="gpt2", batch=1, seq=64).json


def test_scenario_from_a_dict_of_config_keys_equals_the_preset():
    cfg = preset_config("gpt2")
    from_dict = trainmem.estimate(config=cfg, batch=2, seq=256)
    preset = trainmem.estimate(model="gpt2", batch=2, seq=256)
    assert from_dict.memory == preset.memory and from_dict.parameters == preset.parameters
    assert from_dict.model.name == "config.json"


class FakePretrainedConfig:
    """What transformers' PretrainedConfig offers the module: to_dict(), which adds the base class's keys to the
    model's (PretrainedConfig.__init__: _name_or_path, architectures, id2label/label2id, the token ids, dtype, ...;
    None where unset) and transformers_version."""

    def __init__(self, d):
        self.d = d

    def to_dict(self):
        base = {"_name_or_path": "someone/my-gpt2", "transformers_version": "5.0.0", "return_dict": True,
                "output_hidden_states": False, "dtype": "float32", "tie_word_embeddings": True,
                "is_encoder_decoder": False, "architectures": None, "finetuning_task": None,
                "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
                "tokenizer_class": None, "prefix": None, "pad_token_id": None, "sep_token_id": None,
                "decoder_start_token_id": None, "task_specific_params": None, "problem_type": None}
        return {**base, **self.d, "_name_or_path": "someone/my-gpt2"}


def test_scenario_from_a_config_object_with_to_dict():
    s = trainmem.Scenario.from_config(FakePretrainedConfig(preset_config("gpt2")), batch=2, seq=256)
    e = s.estimate()
    assert e.model.name == "someone/my-gpt2/config.json"
    assert e.memory == trainmem.estimate(model="gpt2", batch=2, seq=256).memory


def test_a_config_named_like_a_preset_is_read_not_the_preset():
    cfg = {**preset_config("gpt2"), "n_layer": 2, "_name_or_path": "gpt2"}
    e = trainmem.estimate(config=cfg, batch=1, seq=64)
    assert e.parameters.count < trainmem.estimate(model="gpt2", batch=1, seq=64).parameters.count


def test_scenario_replace_changes_one_field():
    s = trainmem.Scenario(model="gpt2", batch=2, seq=128)
    assert s.replace(batch=4).estimate().setup.batch == 4
    assert s.replace(gpu="rtx-4090").estimate().fits is True


def test_estimate_takes_a_scenario_and_more_keywords():
    s = trainmem.Scenario(model="gpt2", batch=2, seq=128)
    assert trainmem.estimate(s, batch=3).setup.batch == 3
    assert trainmem.fit(s.replace(batch=None), gpu="rtx-4090").largest >= 1


def test_warnings_are_returned_and_issued():
    cfg = {k: v for k, v in preset_config("gpt2").items() if k != "n_layer"}
    with pytest.warns(trainmem.TrainmemWarning, match="n_layer"):
        e = trainmem.estimate(config=cfg, batch=1, seq=64)
    assert any("n_layer" in w for w in e.warnings)


def test_version_is_the_clis():
    from conftest import run_cli
    assert run_cli("--version")[1].strip() == f"trainmem {trainmem.__version__}"


def test_gpus_lists_the_catalog():
    names = [g.name for g in trainmem.gpus()]
    assert "rtx-4090" in names and "h100-80gb" in names


def test_a_model_name_may_come_first():
    assert trainmem.estimate("gpt2", batch=2, seq=128).json == trainmem.estimate(model="gpt2", batch=2, seq=128).json


def test_timeline_arrays_go_to_numpy_without_copying_through_python():
    np = pytest.importorskip("numpy")  # not a dependency: Debian's python3-numpy where it is installed
    t = trainmem.estimate(model="gpt2", batch=1, seq=64).timeline(by="event")
    a = np.frombuffer(t.allocated_bytes, dtype=np.uint64)
    assert a.shape == (len(t),) and int(a.max()) == max(t.allocated_bytes)
    assert np.asarray(t.layer).dtype == np.int64


def test_the_step_time_comes_with_a_gpu_whose_peaks_are_catalogued():
    assert trainmem.estimate(model="gpt2", batch=2, seq=256).time is None
    e = trainmem.estimate(model="gpt2", batch=2, seq=256, gpu="h100-80gb")
    t = e.time
    assert t.step_seconds > 0
    assert t.tokens == 2 * 256
    assert abs(t.tokens_per_second - t.tokens / t.step_seconds) < 1e-6 * t.tokens_per_second
    assert t.breakdown.comm_seconds == 0  # one GPU
