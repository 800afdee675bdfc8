# Bad input raises trainmem.Error with the CLI's message (what `trainmem` prints after "trainmem: ").
import pytest
import trainmem

from conftest import cli_error, run_cli


def python_error(fn, **kw):
    with pytest.raises(trainmem.Error) as e:
        fn(**kw)
    return e.value


@pytest.mark.parametrize("fields,flags", [
    (dict(model="no-such-model"), ["--model", "no-such-model"]),
    (dict(model="gpt2", batch=-3), ["--model", "gpt2", "--batch", "-3"]),
    (dict(model="gpt2", batch="x"), ["--model", "gpt2", "--batch", "x"]),
    (dict(model="gpt2", seq=0), ["--model", "gpt2", "--seq", "0"]),
    (dict(model="gpt2", precision="fp8"), ["--model", "gpt2", "--precision", "fp8"]),
    (dict(model="gpt2", lora="r=0"), ["--model", "gpt2", "--lora", "r=0"]),
    (dict(model="gpt2", gpu="tpu-v5"), ["--model", "gpt2", "--gpu", "tpu-v5"]),
    (dict(model="gpt2", overrides="n_layers=2"), ["--model", "gpt2", "--set", "n_layers=2"]),
    (dict(model="gpt2", checkpoint_reentrant=1), ["--model", "gpt2", "--checkpoint-reentrant", "1"]),
    (dict(model="gpt2", gpus="8xh100-80gb", dp=4), ["--model", "gpt2", "--gpus", "8xh100-80gb", "--dp", "4"]),
])
def test_estimate_error_is_the_clis_message(fields, flags):
    err = python_error(trainmem.estimate, **fields)
    assert str(err) == cli_error("estimate", *flags)


def test_a_field_error_names_its_field():
    err = python_error(trainmem.estimate, model="gpt2", batch=-3)
    assert err.field == "batch" and err.detail == '"-3": expected an integer in [1, 1048576]'
    assert str(err) == '--batch "-3": expected an integer in [1, 1048576]'
    assert isinstance(err, Exception) and type(err).__module__ == "trainmem"


def test_unknown_keyword_is_refused_with_the_nearest_field():
    err = python_error(trainmem.estimate, model="gpt2", bacth=8)
    assert str(err) == 'unknown field "bacth" (did you mean "batch"?)'
    rc, _, stderr = run_cli("estimate", "--model", "gpt2", "--bacth", "8")  # the CLI refuses the flag too
    assert rc == 2 and "--bacth" in stderr


def test_scenario_checks_values_when_built():
    err = python_error(trainmem.Scenario, model="gpt2", optimizer="adamw9")
    assert str(err) == cli_error("estimate", "--model", "gpt2", "--optimizer", "adamw9")


def test_fit_errors_are_the_clis():
    assert str(python_error(trainmem.fit, model="gpt2")) == cli_error("fit", "--model", "gpt2")
    assert str(python_error(trainmem.fit, model="gpt2", gpu="rtx-4090", solve="width")) == \
        cli_error("fit", "--model", "gpt2", "--gpu", "rtx-4090", "--solve", "width")
    assert str(python_error(trainmem.fit, model="gpt2", gpu="rtx-4090", margin=5)) == \
        cli_error("fit", "--model", "gpt2", "--gpu", "rtx-4090", "--margin", "5")
    assert str(python_error(trainmem.fit, model="gpt2", gpu="rtx-4090", batch=4)) == \
        cli_error("fit", "--model", "gpt2", "--gpu", "rtx-4090", "--batch", "4")


def test_params_dtype_error_is_the_clis():
    assert str(python_error(trainmem.params, model="gpt2", dtype="int8")) == \
        cli_error("params", "--model", "gpt2", "--dtype", "int8")


def test_timeline_option_error_is_the_clis():
    e = trainmem.estimate(model="gpt2", batch=1, seq=64)
    with pytest.raises(trainmem.Error) as err:
        e.timeline(by="tensor")
    assert str(err.value) == cli_error("timeline", "--model", "gpt2", "--batch", "1", "--seq", "64", "--by", "tensor")


def test_a_config_error_names_the_config():
    cfg = {"model_type": "gpt2", "n_layer": -1}
    err = python_error(trainmem.estimate, config=cfg)
    assert str(err).startswith("config.json: ")


def test_a_value_python_cannot_give_as_text_is_refused():
    err = python_error(trainmem.estimate, model="gpt2", batch=[1, 2])
    assert "--batch" in str(err) and "list" in str(err)


def test_config_and_model_together_are_refused():
    assert "give one" in str(python_error(trainmem.estimate, model="gpt2", config={"model_type": "gpt2"}))
