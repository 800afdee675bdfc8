# The module and the CLI are one core: for the same scenario, the module's results are the CLI's JSON documents,
# number for number (issue 12's done-when first).
import json

import pytest
import trainmem

from conftest import cli_json, preset_config, run_cli


def test_gpt2_peak_allocated_is_the_clis():
    # issue 12: python3 -c "import trainmem; print(trainmem.estimate(model='gpt2', batch=8, seq=1024)
    # .peak_allocated_bytes)" prints `trainmem estimate --model gpt2 --batch 8 --seq 1024 --format json`'s
    # memory.peak_allocated_bytes
    cli = cli_json("estimate", "--model", "gpt2", "--batch", "8", "--seq", "1024")
    assert trainmem.estimate(model="gpt2", batch=8, seq=1024).peak_allocated_bytes == \
        cli["memory"]["peak_allocated_bytes"]


SCENARIOS = {
    "gpt2_on_a_gpu": dict(model="gpt2", batch=4, seq=512, gpu="rtx-4090"),
    "lora": dict(model="qwen2-0.5b", batch=2, seq=512, precision="bf16",
                 lora="r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj", checkpointing="full", gpu="rtx-4090"),
    "qlora": dict(model="tinyllama-1.1b", batch=2, seq=512, quantize="nf4", double_quant=True,
                  compute_dtype="bf16", lora="r=8,targets=all-linear", optimizer="paged-adamw8bit",
                  checkpointing="full", gpu="24GiB"),
    "multi_gpu": dict(model="gpt2-medium", batch=4, seq=1024, gpus="8xh100-80gb", sharding="zero2",
                      precision="bf16"),
    "ddp": dict(model="gpt2", batch=8, seq=1024, gpus="2xrtx-4090"),
    "fsdp2": dict(model="tinyllama-1.1b", batch=2, seq=512, precision="bf16-amp", gpus="4xa100-80gb",
                  sharding="fsdp2"),
    "inference_generate": dict(model="gpt2", batch=2, seq=128, task="inference", generate=16, precision="fp16"),
    "does_not_fit": dict(model="llama-3-8b", batch=4, seq=4096, gpu="rtx-4090"),
}


def cli_args(fields):
    return trainmem.Scenario(**fields).cli_args()


@pytest.mark.parametrize("name", SCENARIOS)
def test_estimate_document_is_the_clis(name):
    fields = SCENARIOS[name]
    e = trainmem.estimate(**fields)
    assert e.json == cli_json("estimate", *cli_args(fields))
    if "gpu" in fields or "gpus" in fields:
        assert e.device_total_bytes == e.json["memory"]["device_total_bytes"]


@pytest.mark.parametrize("by", ["phase", "layer"])
def test_timeline_columns_are_the_clis_rows(by):
    fields = SCENARIOS["lora"]
    t = trainmem.estimate(**fields).timeline(by=by)
    cli = cli_json("timeline", *cli_args(fields), "--by", by)
    rows = cli.pop("rows")
    assert t.json == cli and len(t) == len(rows)
    for key in ("allocated_bytes", "reserved_bytes", "live_total_bytes", "max_allocated_bytes", "phase", "layer",
                "peak_reserved"):
        assert list(t.columns[key]) == [r[key] for r in rows], key
    assert list(t.live_bytes["activations"]) == [r["live_bytes"]["activations"] for r in rows]


def test_timeline_events_are_the_clis_events():
    fields = dict(model="gpt2", batch=1, seq=32, overrides="n_layer=2", steps=1)
    t = trainmem.estimate(**fields).timeline(by="event", min_bytes=4096, step=1)
    rows = cli_json("timeline", *cli_args(fields), "--by", "event", "--min-bytes", "4096", "--step", "1")["rows"]
    assert list(t.tensor) == [r["tensor"] for r in rows]
    assert list(t.bytes) == [r["bytes"] for r in rows]
    assert list(t.allocated_bytes) == [r["allocated_bytes"] for r in rows]


@pytest.mark.parametrize("solve,size", [("batch", dict(seq=1024)), ("seq", dict(batch=2))])
def test_fit_document_is_the_clis(solve, size):
    fields = dict(model="qwen2-0.5b", gpu="rtx-4090", precision="bf16", **size)
    f = trainmem.fit(solve=solve, margin="2GiB", **fields)
    assert f.json == cli_json("fit", *cli_args(fields), "--solve", solve, "--margin", "2GiB")


def test_fit_that_finds_nothing_is_the_clis():
    fields = dict(model="llama-3-8b", seq=4096, gpu="rtx-4090")
    f = trainmem.fit(**fields)
    assert f.largest is None and f.fits is False
    assert f.json == cli_json("fit", *cli_args(fields))


def test_plan_document_is_the_clis():
    # issue 13's plan from Python: the same search, the same document
    fields = dict(model="gpt2", gpus="8xh100-80gb", seq=1024)
    p = trainmem.plan(global_batch=64, top=3, **fields)
    assert p.json == cli_json("plan", *cli_args(fields), "--global-batch", "64", "--top", "3")
    assert len(p.rows) == 3 and p.rows[0].time.tokens_per_second >= p.rows[1].time.tokens_per_second


def test_plan_names_the_missing_global_batch():
    with pytest.raises(TypeError):
        trainmem.plan(model="gpt2", gpus="8xh100-80gb")  # a required keyword
    with pytest.raises(trainmem.Error, match="--global-batch"):
        trainmem.plan(model="gpt2", gpus="8xh100-80gb", global_batch=0)


def test_params_document_is_the_clis():
    p = trainmem.params(model="phi-2", dtype="bfloat16", lora="r=4")
    assert p.json == cli_json("params", "--model", "phi-2", "--dtype", "bfloat16", "--lora", "r=4")


def test_a_config_dict_gives_the_clis_numbers_for_that_config_json(tmp_path):
    cfg = {**preset_config("llama-3-8b"), "num_hidden_layers": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    fields = dict(batch=2, seq=1024, precision="bf16", gpu="rtx-4090")
    e = trainmem.estimate(config=cfg, **fields)
    cli = cli_json("estimate", "--model", path, *cli_args(fields))
    for doc in (e.json, cli):  # the model's name is where it came from: config.json, or the file's path
        doc["model"].pop("name")
        doc["setup"].pop("model")
    assert e.json == cli


def test_pictures_are_the_clis(tmp_path):
    fields = SCENARIOS["lora"]
    e = trainmem.estimate(**fields)
    run_cli("estimate", *cli_args(fields), "--plot", tmp_path / "breakdown.svg")
    assert e.breakdown_svg() == (tmp_path / "breakdown.svg").read_text()
    run_cli("timeline", *cli_args(fields), "--step", "2", "--plot", tmp_path / "step.svg")
    assert e.timeline_svg(step=2) == (tmp_path / "step.svg").read_text()
    assert e.timeline_svg().startswith("<svg") or e.timeline_svg().startswith("<?xml")
