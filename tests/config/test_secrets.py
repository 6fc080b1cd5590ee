"""Secrets stay secret: a secret at any depth of `checkpoint.storage_options`, or credentials in
a URL (`checkpoint.dir`, `load.weights`, `--resume`, `train export`), are refused with exit 2
and a line that names the key or flag, never the value; and a store that keeps nothing
(`memory://`, a read-only one) is refused before anything starts (issue 52)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from launcher.checkpoint.store_errors import unusable
from launcher.config.loader import load_spec_and_sources
from launcher.errors import UsageError
from launcher.storage_url import (
    has_url_credentials,
    location,
    mask_override,
    mask_urls,
    names_a_secret,
    secrets_in,
    unkept_store_problem,
)
from tests.conftest import only_run_dir, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork

VALUE = "fakeSecretVALUE9x"  # what no output may show
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
# AWS secret keys hold `/` and `+`: a URL's user-info that looks like a path.
CREDENTIALS_URL = f"s3://{KEY_ID}:{VALUE}/a+b@bucket/prefix"
MINIMAL = "recipe: {source: r.py}\ntrain: {max_steps: 5}\n"


# --- the rule: which names and URLs hold a secret, and what is shown instead


@pytest.mark.parametrize(
    "name",
    [
        "key",
        "secret",
        "token",
        "aws_secret_access_key",
        "AWSSecretAccessKey",
        "aws_access_key_id",
        "SessionToken",
        "sas_token",
        "account_key",
        "connection_string",
        "credentials",
        "client_secret",
        "db_password",
        "SSECustomerKey",
        "sse_customer_key",
        "CopySourceSSECustomerKey",
        "Authorization",
    ],
)
def test_names_that_hold_a_secret(name: str) -> None:
    assert names_a_secret(name)


@pytest.mark.parametrize(
    "name",
    [
        "endpoint_url",
        "region_name",
        "client_kwargs",
        "SSECustomerAlgorithm",
        "SSEKMSKeyId",
        "anon",
        "profile",
        "tokenizer",
        "max_tokens",
    ],
)
def test_names_that_hold_none(name: str) -> None:
    assert not names_a_secret(name)


def test_secrets_are_found_at_any_depth_and_named_by_their_dotted_key() -> None:
    options = {
        "endpoint_url": "http://127.0.0.1:9000",
        "client_kwargs": {"region_name": "x", "aws_secret_access_key": VALUE},
        "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": VALUE},
        "config_kwargs": [{"retries": 3}, {"Password": VALUE}],
        "proxy": f"http://user:{VALUE}@proxy:3128",
        f"secret:{VALUE}": None,  # YAML's reading of `{secret:VALUE}`: a key holding its value
    }
    found = secrets_in(options, "checkpoint.storage_options")
    keys = [key for key, _ in found]
    assert keys == [
        "checkpoint.storage_options.client_kwargs.aws_secret_access_key",
        "checkpoint.storage_options.s3_additional_kwargs.SSECustomerKey",
        "checkpoint.storage_options.config_kwargs[1].Password",
        "checkpoint.storage_options.proxy",
        "checkpoint.storage_options.secret…",
    ]
    assert "AWS_SECRET_ACCESS_KEY" in found[0][1] and "SSE-KMS" in found[1][1]
    assert VALUE not in repr(found)
    assert secrets_in({"endpoint_url": "http://127.0.0.1:9000", "anon": False}, "x") == []


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (CREDENTIALS_URL, "s3://***@bucket/prefix"),
        (f"s3://{KEY_ID}:p@ss@bucket/x", "s3://***@bucket/x"),  # a password holding `@`
        (f"s3://{KEY_ID}@bucket/x", "s3://***@bucket/x"),  # a key as the user
        ("gs://user:pw@bucket/x", "gs://***@bucket/x"),
    ],
)
def test_url_credentials_are_found_and_masked(url: str, masked: str) -> None:
    assert has_url_credentials(url)
    assert mask_urls(url) == masked
    assert mask_urls(f"--resume {url}: no such folder") == f"--resume {masked}: no such folder"


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/prefix/{run}",
        "s3://bucket/model@v2/x",  # an `@` in the path
        "http://127.0.0.1:9000/a@b",  # host:port, then a path
        "abfs://container@account.dfs.core.windows.net/x",  # Azure's container: a name
        "file:///shared/folder",
    ],
)
def test_urls_without_credentials_pass(url: str) -> None:
    assert not has_url_credentials(url)


def test_an_override_that_holds_a_secret_is_shown_without_its_value() -> None:
    for text in (
        f"checkpoint.storage_options={{secret: {VALUE}}}",
        f"checkpoint.storage_options={{client_kwargs: [{{aws_secret_access_key: {VALUE}}}]}}",
        f"checkpoint.storage_options.client_kwargs.aws_secret_access_key={VALUE}",
        f"checkpoint={{storage_options: {{token: {VALUE}}}}}",
        f"checkpoint.storage_options={{secret: {VALUE}",  # YAML cannot read it: still masked
    ):
        shown = mask_override(text)
        assert VALUE not in shown and shown.endswith("=***"), shown
    assert mask_override(f"checkpoint.dir={CREDENTIALS_URL}") == (
        "checkpoint.dir=s3://***@bucket/prefix"
    )


def test_an_override_without_a_secret_is_shown_as_given() -> None:
    for text in (
        "train.max_steps=30",
        "checkpoint.dir=s3://bucket/{run}",
        "checkpoint.storage_options={endpoint_url: http://127.0.0.1:9000}",
        "recipe.model.pad_token=0",  # a recipe's argument: no store secret
        "recipe.dataset.tokenizer=gpt2",
    ):
        assert mask_override(text) == text


def test_masking_reads_a_long_override_once() -> None:
    """An override may be 100,000 characters (its error says how long): masking it must not
    read it once per letter."""
    started = time.monotonic()
    for text in ("a" * 200_000, "a://" * 50_000, "checkpoint.storage_options=" + "a: " * 60_000):
        assert mask_override(text).startswith(text[:20])
    assert time.monotonic() - started < 3


def test_a_store_error_never_repeats_a_urls_credentials() -> None:
    cause = OSError(f"cannot reach http://user:{VALUE}@proxy:3128")
    error = unusable(CREDENTIALS_URL, cause, "--resume")
    assert VALUE not in error.render() and KEY_ID not in error.render()
    assert error.message.startswith("--resume s3://***@bucket/prefix: ")


@pytest.mark.parametrize("flag", ["--resume", "train export", "load.weights"])
def test_a_location_with_credentials_is_refused_without_them(flag: str) -> None:
    with pytest.raises(UsageError) as info:
        location(CREDENTIALS_URL, what=flag)
    said = info.value.render()
    assert said.startswith(f"{flag} s3://***@bucket/prefix: credentials in a URL are refused")
    assert VALUE not in said and KEY_ID not in said


class _ScratchFileSystem(MemoryFileSystem):
    protocol = "launcher-test-scratch"


@pytest.mark.parametrize(
    "url", ["memory://m/{run}", "launcher-test-scratch://x", "https://host/x", "zip://a.zip"]
)
def test_stores_that_keep_nothing_are_named(url: str) -> None:
    fsspec.register_implementation("launcher-test-scratch", _ScratchFileSystem, clobber=True)
    assert unkept_store_problem(url) is not None


@pytest.mark.parametrize("url", ["s3://bucket/x", "gs://bucket/x", "file:///shared/x"])
def test_stores_that_keep_checkpoints_pass(url: str) -> None:
    assert unkept_store_problem(url) is None


# --- the spec: refused with the dotted key, never the value


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(MINIMAL + text)
    return path


def _errors(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UsageError) as info:
        load_spec_and_sources(path, overrides)
    assert info.value.exit_code == 2
    return info.value.render()


def test_a_nested_secret_in_the_yaml_is_refused_by_its_dotted_key(tmp_path: Path) -> None:
    text = (
        "checkpoint:\n  dir: s3://bucket/{run}\n  storage_options:\n"
        f"    client_kwargs: {{aws_secret_access_key: {VALUE}}}\n"
        f"    s3_additional_kwargs: {{SSECustomerAlgorithm: AES256, SSECustomerKey: {VALUE}}}\n"
    )
    said = _errors(_spec(tmp_path, text))
    assert "1 problem" in said and VALUE not in said
    assert (
        "checkpoint.storage_options.client_kwargs.aws_secret_access_key holds a secret, which "
        "the spec never holds (the run saves it): set AWS_SECRET_ACCESS_KEY in the environment"
    ) in said
    assert "(also s3_additional_kwargs.SSECustomerKey)" in said


def test_a_secret_given_as_an_override_is_refused_without_its_value(tmp_path: Path) -> None:
    said = _errors(_spec(tmp_path, ""), [f"checkpoint.storage_options={{secret: {VALUE}}}"])
    assert VALUE not in said
    assert "checkpoint.storage_options (override checkpoint.storage_options=***): " in said
    assert "checkpoint.storage_options.secret holds a secret" in said


@pytest.mark.parametrize("key", ["checkpoint.dir", "load.weights"])
def test_credentials_in_a_spec_url_are_refused_without_them(tmp_path: Path, key: str) -> None:
    said = _errors(_spec(tmp_path, ""), [f"{key}={CREDENTIALS_URL}"])
    assert VALUE not in said and KEY_ID not in said
    assert f"{key} (override {key}=s3://***@bucket/prefix): s3://***@bucket/prefix: " in said
    assert "credentials in a URL are refused" in said


def test_a_memory_store_is_refused_naming_why_and_what_to_use(tmp_path: Path) -> None:
    said = _errors(_spec(tmp_path, "checkpoint: {dir: 'memory://m/{run}'}\n"))
    assert "checkpoint.dir (line 3): memory:// keeps files in each process's memory" in said
    assert "s3://bucket/prefix/{run}" in said  # what to use instead


def test_a_non_secret_override_keeps_its_label(tmp_path: Path) -> None:
    overrides = ["train.max_steps=30", "checkpoint.storage_options={endpoint_url: http://h:1}"]
    _, sources = load_spec_and_sources(_spec(tmp_path, ""), overrides)
    assert sources["train.max_steps"].startswith("override train.max_steps=30 (over ")
    assert sources["checkpoint.storage_options"] == (
        "override checkpoint.storage_options={endpoint_url: http://h:1}"
    )


# --- the command line: exit 2, one line, the value nowhere in the output


def _refused(result, *expected: str) -> str:  # type: ignore[no-untyped-def]
    usage_error(result, *expected)
    output = result.stdout + result.stderr
    assert VALUE not in output and KEY_ID not in output, output
    return output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["validate"], []], ids=["validate", "train"])
def test_train_refuses_secrets_in_overrides_before_it_starts(
    tmp_path: Path, command: list[str]
) -> None:
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 2})
    for override, expected in [
        (
            f"checkpoint.storage_options={{client_kwargs: {{aws_secret_access_key: {VALUE}}}}}",
            "checkpoint.storage_options.client_kwargs.aws_secret_access_key holds a secret",
        ),
        (
            f"checkpoint.storage_options={{s3_additional_kwargs: [{{SSECustomerKey: {VALUE}}}]}}",
            "checkpoint.storage_options.s3_additional_kwargs[0].SSECustomerKey holds a secret",
        ),
        (f"checkpoint.dir={CREDENTIALS_URL}", "override checkpoint.dir=s3://***@bucket/prefix"),
    ]:
        args = [*command, "--config", str(spec), "checkpoint.every_n_steps=1", override]
        _refused(train_in_fork(args, cwd=tmp_path), expected)
    assert not (tmp_path / "runs").exists()  # refused before a run folder


@pytest.mark.timeout(120)
def test_train_validate_refuses_secrets_nested_in_the_yaml(tmp_path: Path) -> None:
    options = {
        "client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": VALUE},
        "s3_additional_kwargs": [{"SSECustomerAlgorithm": "AES256", "SSECustomerKey": VALUE}],
    }
    spec = write_spec(
        tmp_path / "run.yaml", checkpoint={"dir": "s3://bucket/{run}", "storage_options": options}
    )
    result = train_in_fork(["validate", "--config", str(spec)], cwd=tmp_path)
    _refused(
        result,
        "checkpoint.storage_options.client_kwargs.aws_secret_access_key holds a secret",
        "set AWS_SECRET_ACCESS_KEY in the environment instead",
        "(also s3_additional_kwargs[0].SSECustomerKey)",
    )


@pytest.mark.timeout(120)
def test_credentials_in_a_url_flag_are_refused_without_them(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 2})
    masked = "s3://***@bucket/prefix: credentials in a URL are refused"
    for args, expected in [
        (["--config", str(spec), "--resume", CREDENTIALS_URL], f"--resume {masked}"),
        (["--resume", CREDENTIALS_URL], f"--resume {masked}"),
        (["export", CREDENTIALS_URL, "--out", "m.pt"], f"train export {masked}"),
        (["--config", str(spec), "--load-weights", CREDENTIALS_URL], "load.weights (--load"),
    ]:
        _refused(train_in_fork(args, cwd=tmp_path), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["validate"], []], ids=["validate", "train"])
def test_a_store_that_keeps_nothing_is_refused_in_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 2})
    result = train_in_fork(
        [*command, "--config", str(spec), "checkpoint.dir=memory://m/{run}"], cwd=tmp_path
    )
    output = _refused(result, "memory:// keeps files in each process's memory")
    assert len([line for line in output.splitlines() if "checkpoint.dir" in line]) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(180)
def test_a_run_with_a_store_keeps_its_overrides_labels(tmp_path: Path) -> None:
    """A run that starts: spec.yaml names each override as it was given, and the records that
    name the store hold its options, none of them masked."""
    # A folder that is there: UPath writes a file:// path as a local file, so the store check's
    # probe needs its folder, whatever `auto_mkdir` says.
    (tmp_path / "store").mkdir()
    store = f"file://{tmp_path / 'store'}"
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        train={"max_steps": 2},
        checkpoint={"dir": store},
    )
    options = "checkpoint.storage_options={auto_mkdir: true}"
    result = run_train(["--config", str(spec), "train.max_steps=3", options], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    saved = (run_dir / "spec.yaml").read_text()
    assert "# override train.max_steps=3 (over " in saved
    assert "# storage_options: override checkpoint.storage_options={auto_mkdir: true}" in saved
    record = json.loads((run_dir / "checkpoint-store.json").read_text())
    assert record["storage_options"] == {"auto_mkdir": True}
