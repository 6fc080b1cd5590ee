"""`train export` of a model with tied weights (GPT-2: the LM head is the token embedding):
`--ema` gives every name of a tied weight the average, and `--hf DIR` writes a folder that
`from_pretrained` loads. The exports are checked against what the run itself logged: the
loaded model's loss on the val split is the run's last `val/loss` (or `val_ema/loss`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from launcher.checkpoint.hf_export import export_hf
from launcher.checkpoint.whole_model import read_model
from launcher.cli.export import recipe_model
from launcher.errors import UsageError
from launcher.rundir.layout import CheckpointFiles, RunLayout
from tests.conftest import REPO, metrics_of, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [
    pytest.mark.timeout(240),
    # DCP in this process, on purpose: the reference route and the fake checkpoints.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

GPT2 = REPO / "recipes" / "hf_gpt2.py"
MODEL = {"n_layer": 1, "n_embd": 32}
DATASET = {"n_samples": 64, "seq_len": 16}
WTE, LM_HEAD = "transformer.wte.weight", "lm_head.weight"  # one tensor in GPT-2


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-2 (tied) on 2 CPU processes under fsdp, with a fast average (decay 0.5) that
    differs from the weights, evaluated and checkpointed at its last step."""
    folder = tmp_path_factory.mktemp("gpt2")
    spec = write_spec(
        folder / "run.yaml",
        launch={"accelerator": "cpu", "devices": 2, "strategy": "fsdp"},
        recipe={"source": str(GPT2), "model": MODEL, "dataset": DATASET},
        data={"batch_size": 4},
        optim={"name": "AdamW", "lr": 0.01},
        train={"max_steps": 4, "log_every": 2, "ema": {"decay": 0.5}},
        eval={"every_n_steps": 4},
    )
    result = run_train(["--config", str(spec), "--run-dir", str(folder / "run")], folder, 200)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "run"


def _logged(run: Path) -> dict[str, float]:
    """The run's last evaluation: {"val/loss": ..., "val_ema/loss": ...}."""
    (last,) = [r for r in metrics_of(run) if "val/loss" in r][-1:]
    assert last["step"] == 4
    return {key: last[key] for key in ("val/loss", "val_ema/loss")}


def _val_loss(model: torch.nn.Module) -> float:
    """The recipe's loss over the whole val split, as the run's evaluation computes it (the
    mean over samples: every sample has as many tokens, so one batch of them all gives it)."""
    from recipes.hf_gpt2 import build_dataset

    val = build_dataset("val", **DATASET)
    batch = {key: torch.stack([val[i][key] for i in range(len(val))]) for key in val[0]}
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


def _export(run: Path, *args: str) -> None:
    result = train_in_fork(["export", str(run), *args], cwd=run.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def _average_of_the_embedding(run: Path) -> torch.Tensor:
    """The checkpoint's `ema.transformer.wte.weight`, read by DCP here: another route."""
    from recipes.hf_gpt2 import build_model

    average = {"ema": {WTE: build_model(**MODEL).state_dict()[WTE]}}
    dcp.load(average, checkpoint_id=RunLayout(run).checkpoint(4), no_dist=True)
    return average["ema"][WTE]


def test_the_ema_export_of_tied_weights_scores_the_logged_val_ema(
    tied_run: Path, tmp_path: Path
) -> None:
    from recipes.hf_gpt2 import build_model

    logged = _logged(tied_run)
    assert logged["val_ema/loss"] != pytest.approx(logged["val/loss"], rel=1e-3)  # tells apart
    out = tmp_path / "average.safetensors"
    _export(tied_run, "--ema", "--out", str(out))
    state = safetensors_torch.load_file(out)
    # Every name of the tied weight holds the average (the bug: the LM head kept the weights).
    assert torch.equal(state[LM_HEAD], _average_of_the_embedding(tied_run))
    assert torch.equal(state[WTE], state[LM_HEAD])
    model = build_model(**MODEL)
    model.load_state_dict(state, strict=True)
    assert _val_loss(model) == pytest.approx(logged["val_ema/loss"], rel=1e-5)


def test_from_pretrained_loads_the_hf_export_with_the_runs_scores(
    tied_run: Path, tmp_path: Path
) -> None:
    logged = _logged(tied_run)
    trained, average = tmp_path / "trained", tmp_path / "average"
    _export(tied_run, "--hf", str(trained), "--max-shard-size", "30KB")
    _export(tied_run, "--ema", "--hf", str(average))
    files = sorted(p.name for p in trained.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    index = json.loads((trained / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # split above --max-shard-size
    assert WTE in index["weight_map"] and LM_HEAD not in index["weight_map"]  # tied: once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["average", "trained"]  # no leftover

    for folder, key in ((trained, "val/loss"), (average, "val_ema/loss")):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert type(model).__name__ == "GPT2LMHeadModel"
        assert model.lm_head.weight is model.transformer.wte.weight
        assert _val_loss(model) == pytest.approx(logged[key], rel=1e-5), key


# No run needed: what is refused is refused before a tensor is read.


def _fake_checkpoint(folder: Path, recipe: Path, model_state: dict) -> Path:
    """A checkpoint as the launcher publishes one, recording `recipe` as its run's."""
    dcp.save({"model": model_state}, checkpoint_id=folder, no_dist=True)
    files = CheckpointFiles(folder)
    spec = {"recipe": {"source": str(recipe), "model": {}, "dataset": {}}}
    files.meta.write_text(json.dumps({"spec": spec, "config_file": None}))
    files.marker.write_text("")
    return folder


def test_hf_export_of_a_model_that_is_not_hugging_faces_names_the_plain_export(
    tmp_path: Path,
) -> None:
    from recipes.mlp import build_model

    checkpoint = _fake_checkpoint(tmp_path / "ckpt", REPO / "recipes" / "mlp.py",
                                  build_model().state_dict())  # fmt: skip
    result = train_in_fork(["export", str(checkpoint), "--hf", str(tmp_path / "hf")], tmp_path)
    usage_error(result, "--hf: the recipe's model is a Sequential, not a Hugging Face", "--out")
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_hf_export_never_writes_into_a_folder_that_holds_anything(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", GPT2, {"w": torch.ones(3)})
    taken = tmp_path / "hf"
    taken.mkdir()
    (taken / "mine.txt").write_text("mine")
    result = train_in_fork(["export", str(checkpoint), "--hf", str(taken)], tmp_path)
    usage_error(result, f"--hf {taken}: this folder is not empty; it is never overwritten")
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    assert (taken / "mine.txt").read_text() == "mine"


def test_hf_export_creates_the_folders_above_its_folder(tmp_path: Path) -> None:
    """It was refused, "no folder ...", where `save_pretrained` itself creates them."""
    from recipes.hf_gpt2 import build_model

    checkpoint = _fake_checkpoint(tmp_path / "ckpt", GPT2, build_model().state_dict())
    out = tmp_path / "exports" / "gpt2" / "hf"
    result = train_in_fork(["export", str(checkpoint), "--hf", str(out)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["hf"]  # no partial folder left beside
    # A file where a folder would be created is one line, and nothing is read or made.
    (tmp_path / "notes").write_text("mine")
    blocked = tmp_path / "notes" / "gpt2" / "hf"
    refused = train_in_fork(["export", str(checkpoint), "--hf", str(blocked)], tmp_path)
    usage_error(refused, f"--hf {blocked}: {tmp_path / 'notes'} is a file, where a folder")
    assert (tmp_path / "notes").read_text() == "mine"


def test_export_takes_out_or_hf(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", GPT2, {"w": torch.ones(3)})
    neither = train_in_fork(["export", str(checkpoint)], tmp_path)
    usage_error(neither, "give --out FILE (a state_dict) or --hf DIR")
    both = ["--out", str(tmp_path / "m.pt"), "--hf", str(tmp_path / "hf")]
    usage_error(train_in_fork(["export", str(checkpoint), *both], tmp_path), "one of the two")
    size = ["--hf", str(tmp_path / "hf"), "--max-shard-size", "5 gigs"]
    usage_error(
        train_in_fork(["export", str(checkpoint), *size], tmp_path), "--max-shard-size 5 gigs"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_recipe_that_no_longer_ties_what_the_checkpoint_holds_apart_is_refused(
    tmp_path: Path,
) -> None:
    """The recipe's model ties `a` and `b`, but the run saved two different tensors: the
    recipe changed since, and its ties are not applied to the checkpoint."""
    checkpoint = _fake_checkpoint(
        tmp_path / "ckpt", GPT2, {"a.weight": torch.zeros(2, 2), "b.weight": torch.ones(2, 2)}
    )
    tied = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2, bias=False)})
    tied["b"] = torch.nn.Linear(2, 2, bias=False)
    tied["b"].weight = tied["a"].weight
    refusal = r"ties b\.weight to a\.weight, but the checkpoint holds different values"
    with pytest.raises(UsageError, match=refusal):
        read_model(checkpoint, recipe_model=lambda _: tied)
    # Tied as the run saved them: one tensor under both names.
    same = _fake_checkpoint(tmp_path / "same", GPT2, {"a.weight": torch.ones(2, 2),
                                                      "b.weight": torch.ones(2, 2)})  # fmt: skip
    read = read_model(same, recipe_model=lambda _: tied)
    assert read.tensors["a.weight"] is read.tensors["b.weight"]


def test_ema_without_the_recipe_says_why_it_is_needed(tmp_path: Path) -> None:
    checkpoint = _fake_checkpoint(tmp_path / "ckpt", tmp_path / "gone.py", {"w": torch.ones(3)})
    with pytest.raises(UsageError, match="does not exist") as refused:
        recipe_model(checkpoint)
    assert "--ema and --hf build the run's model from its recipe" in refused.value.hint


def test_every_name_of_a_bart_tied_weight_gets_the_average(tmp_path: Path) -> None:
    """BART ties four names (the shared embedding, both embed_tokens, the LM head); the
    checkpoint keeps the average under the first one only."""
    config = transformers.BartConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config)
    average = {name: p.detach() + 1 for name, p in model.named_parameters()}
    assert "model.shared.weight" in average and "lm_head.weight" not in average
    checkpoint = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict(), "ema": average}, checkpoint_id=checkpoint, no_dist=True)
    CheckpointFiles(checkpoint).marker.write_text("")
    with torch.device("meta"):
        recipes_model = transformers.BartForConditionalGeneration(config)

    export_hf(checkpoint, tmp_path / "hf", ema=True, recipe_model=lambda _: recipes_model)
    loaded = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "hf")
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens",
                 "lm_head"):  # fmt: skip
        weight = loaded.get_submodule(name).weight
        assert torch.equal(weight, average["model.shared.weight"]), name
