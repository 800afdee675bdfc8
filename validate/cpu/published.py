#!/usr/bin/python3
"""Parameter counts of the reference models (validate/cpu/models.py) for the preset config.json files,
built on the meta device (no memory), against the published exact counts (/work/research/param_counts.md)
and, with --trainmem, against `trainmem params --format json` / `trainmem estimate`.

    /usr/bin/python3 validate/cpu/published.py [--trainmem build/trainmem]
"""

import argparse
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# sum(p.numel() for p in model.parameters()) of the real models, tied weights counted once.
PUBLISHED = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096, "tinyllama-1.1b": 1_100_048_384, "qwen2-0.5b": 494_032_768,
    "qwen2-0.5b-instruct": 494_032_768, "qwen2-1.5b-instruct": 1_543_714_304, "qwen3-0.6b": 596_049_920,
    "gemma-2b": 2_506_172_416, "gemma-2-2b": 2_614_341_888, "phi-3-mini": 3_821_079_552,
    "pythia-160m": 162_322_944, "opt-125m": 125_239_296, "llama-3.2-1b-instruct": 1_235_814_400,
    "smollm2-135m": 134_515_008, "mixtral-8x7b": 46_702_792_704,
    # Hugging Face Hub model API, microsoft/phi-2: safetensors.parameters {"F16": 2779683840} (untied, lm_head.bias)
    "phi-2": 2_779_683_840,
    # Hugging Face Hub model API, meta-llama/Llama-3.3-70B-Instruct (the Llama-3.1-70B architecture):
    # safetensors.total 70553706496, as public fixtures of that API record it
    "llama-3.1-70b": 70_553_706_496,
    "gemma-3-1b-it": 999_885_952,  # keras-hub gemma3_presets.py@46f3b4a gemma3_instruct_1b
    # keras-hub qwen3_moe_presets.py@79c5664 qwen3_moe_30b_a3b_en, qwen_moe_presets.py@41e055b qwen1.5_moe_2.7b_en
    "qwen3-30b-a3b": 30_532_122_624, "qwen1.5-moe-a2.7b": 14_315_784_192,
    # keras-hub bert_presets.py@0e1444f bert_base_en_uncased: BertBackbone, i.e. BertModel with its pooler and no
    # task head; the preset is BertForMaskedLM, so the count is taken of BertModel (MODULE_SETS)
    "bert-base-uncased": 109_482_240,
    # keras-hub roberta_presets.py@d7a5c31 roberta_base_en: RobertaBackbone (roberta_backbone.py@7eea6c8): token
    # and position embeddings (max_sequence_length=512 rows), LayerNorm, the encoder layers; no token type
    # embeddings, no pooler, no head (MODULE_SETS)
    "roberta-base": 124_052_736,
    "falcon-rw-1b": 1_311_625_216,  # keras-hub falcon_presets.py@aa42194 falcon_refinedweb_1b_en
    # keras-nlp t5_presets.py t5_small "params" (mattdangerw/keras-hub@0df99da keras_nlp/models/t5/t5_presets.py);
    # T5.1.1 / flan base: sdpetrides/t5x-train-and-test README.md@7742ecb t5x "base" 247577856
    "t5-small": 60_506_624, "flan-t5-base": 247_577_856,
    # nanoGPT GPT-2 small as configured in data/models/nanogpt-gpt2.json (no published figure: nanoGPT's own
    # get_num_params() subtracts wpe; this is sum(numel)).
}


# A published count of another module set than the preset's model: (what the reference counts, trainmem flags,
# prefix of the parameter names trainmem leaves out). bert-base-uncased: BertModel(config) with the pooler =
# BertForSequenceClassification less its classifier.
MODULE_SETS = {
    "bert-base-uncased": (lambda m: m.bert if hasattr(m, "bert") else m,
                          ["--head", "seq-cls"], "classifier."),
    # RobertaModel(add_pooling_layer=False) less its token_type_embeddings (keras-hub has none) and less the
    # padding_idx + 1 = 2 position rows no position id reaches (create_position_ids_from_input_ids starts at 2;
    # keras-hub's PositionEmbedding has the 512 rows that are reached)
    "roberta-base": (lambda m: m.roberta, ["--head", "token-cls"],
                     ("classifier.", "roberta.embeddings.token_type_embeddings."), 2 * 768),
}
# the architecture each MODULE_SETS reference model is built with (its backbone is the module set's base)
_MODULE_SET_ARCH = {"bert-base-uncased": "BertForSequenceClassification",
                    "roberta-base": "RobertaForTokenClassification"}


def trainmem_count(binary, path, flags=(), minus=None):
    p = subprocess.run([binary, "params", "--model", path, "--format", "json"] + list(flags),
                       capture_output=True, text=True)
    if p.returncode != 0:
        return None
    rows = json.loads(p.stdout)["parameters"]
    return sum(r["elements"] for r in rows if not (minus and r["name"].startswith(minus)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainmem", help="also compare with trainmem's parameter count")
    a = ap.parse_args()
    files = sorted(glob.glob(os.path.join(ROOT, "data", "models", "*.json"))) + sorted(
        glob.glob(os.path.join(ROOT, "tests", "testdata", "configs", "*.json")))
    bad = 0
    print(f"{'config':26s} {'reference model':>16s} {'published':>16s} {'trainmem':>16s}  status")
    for f in files:
        name = os.path.basename(f)[:-5]
        with open(f) as fh:
            cfg = json.load(fh)
        sub, flags, minus, *less = MODULE_SETS.get(name, (None, (), None))
        less = less[0] if less else 0
        try:
            if sub is None:
                n, _ = models.count_parameters(cfg)
            else:  # the backbone of a task model (BertModel with its pooler; RobertaModel without)
                m = models.build_model({**cfg, "architectures": [_MODULE_SET_ARCH[name]]}, device="meta")
                n = sum(p.numel() for p in sub(m).parameters() if not (
                    name == "roberta-base" and p is m.roberta.embeddings.token_type_embeddings.weight)) - less
        except ValueError as e:
            print(f"{name:26s} {'-':>16s}  skipped: {e}")
            continue
        pub = PUBLISHED.get(name)
        tm = trainmem_count(a.trainmem, f, flags, minus) if a.trainmem else None
        tm = tm - less if tm is not None else None
        ok = (pub is None or pub == n) and (tm is None or tm == n)
        bad += not ok
        fmt = lambda v: "-" if v is None else format(v, ",")  # noqa: E731
        print(f"{name:26s} {n:16,d} {fmt(pub):>16} {fmt(tm):>16}  {'ok' if ok else 'MISMATCH'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
