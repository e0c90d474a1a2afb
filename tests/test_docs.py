"""Every fenced block of README.md and docs/*.md is run here, or skipped with its reason.

Sybil finds the blocks (its Markdown fence lexer: tagged or not, indented in list items, with
their line numbers), so this module keeps no Markdown parser of its own; Sybil's own evaluators
run a block in this process, and ours are multi-process jobs (torchrun, a launcher, a shell), so
the blocks become this module's parametrized tests rather than Sybil's pytest items (and
tests/conftest.py stays as it is). pytest's doctest and pytest-examples fit neither: our blocks
are scripts for several ranks and shell commands, not ``>>>`` sessions or single-process code.

What each block gets:

- a ```python block: run as a script on 2 CPU ranks under torchrun, warnings as errors (each
  distinct script once: README.md repeats docs/compiled-step.md's), unless ``NOT_RUN`` names it;
- a command block named in ``RUN`` (below the functions that run its blocks): run as its
  function says, the README's quick start in the quick tier too;
- a command block named in ``RUN_BY_TEST_FRAMEWORKS``: tests/test_frameworks.py runs that very
  command (adding ``--backend smddp --out FILE``), so it is checked here, not run a second time;
- a block named in ``NOT_RUN``: reported as skipped, with the reason given there.

A block that none of these names fails ``test_every_block_is_run_or_has_a_reason_not_to_be``,
as does an entry that names no block, so the layer stays complete as the documents change.
Blocks are named by their file and a substring unique to them in that file, not by line, so
edits elsewhere in a document do not move them. Last, every ``SMDDP_*`` variable the documents
name must be one that ``smddp_lite.config.read_env`` knows.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings

import pytest
from sybil import Sybil
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

from . import harness, tiers

DOCUMENTS = ["README.md", *sorted(str(p.relative_to(harness.ROOT)) for p in (harness.ROOT / "docs").glob("*.md"))]

GPU = "needs a CUDA GPU (CI has none)"
HOSTS = "needs several hosts (CI is one machine)"
DOCKER = "needs Docker (CI has none)"
AWS = "needs an AWS account"
OUTPUT = "sample output, not a command"
FRAGMENT = "a fragment ({} undefined): the complete script is {}, which the next block runs"

# (document, a substring unique to the block there) -> why the block is not run
NOT_RUN = {
    ("README.md", "python3 -m venv .venv"):
        ".ci/run makes CI's virtual environment with this very command",
    ("README.md", 'pip install torch==2.13.0 -e ".[test]" && python -m pytest'):
        ".ci/run runs this command itself (with --full); a test cannot start the suite it is part of",
    ("README.md", "--index-url https://download.pytorch.org/whl/cpu"):
        "installs torch from PyTorch's index: .ci/run installs torch==2.13.0 itself",
    ("README.md", 'pip install -e ".[cuda12]"'): f"{GPU}: cupy and NCCL for a CUDA version",
    ("README.md", "smddp_lite/     the user's surface"): "the repository's folders, not a command",
    ("docs/architecture.md", "user script ──►"): "a diagram, not a command",
    ("docs/clusters.md", "torchrun --nnodes 4"): f"{HOSTS}: 4, of 8 GPUs each",
    ("docs/clusters.md", "node0:8"): f"{HOSTS}: node0 and node1",
    ("docs/clusters.md", "node0 slots=8"): f"{HOSTS}: node0 and node1, with Open MPI",
    ("docs/clusters.md", "#SBATCH"): f"a Slurm batch script: {HOSTS}: a Slurm cluster of 4 GPU hosts",
    ("docs/clusters.md", "export FI_PROVIDER=efa"): f"{AWS}: an EFA device (p4d/p5 instances)",
    ("docs/clusters.md", "network plugin:"): OUTPUT,
    ("docs/clusters.md", "uses transport hierarchical"): OUTPUT,
    ("docs/clusters.md", "runs hierarchical (2 hosts"): OUTPUT,
    ("docs/clusters.md", "crosses 8 hosts in a chain"): OUTPUT,
    ("docs/docker.md", "docker build -f docker/Dockerfile -t smddp-lite:cpu"): f"{DOCKER}; its last line a GPU too",
    ("docs/docker.md", "aws-efa-installer"): f"Dockerfile lines, not a command; {AWS}: an EFA device",
    ("docs/docker.md", "docker/offline-base.sh"): DOCKER,
    ("docs/docker.md", "aws ecr create-repository"): f"{AWS} (ECR) and Docker",
    ("docs/docker.md", "from sagemaker.pytorch import PyTorch"):
        f"{AWS}: a SageMaker job (IAM role, ECR image, S3 data, p4d instances)",
    ("docs/docker.md", "docker/sagemaker_local.py"): f"{DOCKER}: SageMaker's local mode runs the image",
    ("docs/errors.md", "Not all ranks joining collective"): OUTPUT,
    ("docs/frameworks.md", "from transformers import Trainer"):
        FRAGMENT.format("model, dataset, ...", "smddp_lite/examples/hf_trainer.py"),
    ("docs/frameworks.md", "from accelerate import Accelerator"):
        FRAGMENT.format("model, optimizer, loader", "smddp_lite/examples/accelerate_loop.py"),
    ("docs/frameworks.md", "import lightning as L"):
        FRAGMENT.format("model, loader", "smddp_lite/examples/lightning_fit.py"),
    ("docs/frameworks.md", "from smddp_lite.lightning_strategy import CompiledStepStrategy"):
        FRAGMENT.format("L, model, loader", "smddp_lite/examples/lightning_fit.py"),
    ("docs/frameworks.md", "from smddp_lite.hf_trainer import CompiledStepTrainer"):
        FRAGMENT.format("model, args, dataset", "smddp_lite/examples/hf_trainer.py"),
    ("docs/frameworks.md", "get_state_dict(compiled.module"):
        FRAGMENT.format("compiled, directory, ...", "smddp_lite/examples/dcp_resume.py"),
    ("docs/gpus.md", 'pip install -e ".[cuda12]"'): f"{GPU}: cupy and NCCL for a CUDA version",
    ("docs/gpus.md", "--device cuda"): GPU,
    ("docs/gpus.md", "gpu_checks.sh"): GPU,
    ("docs/surviving.md", "TCPStore('$STORE_ADDR', 29500"):
        f"{HOSTS}: a recipe whose ranks get RANK, WORLD_SIZE and MASTER_ADDR by hand, "
        "and a store on fixed port 29500 that runs until killed",
}

# (document, substring): the blocks that tests/test_frameworks.py runs (one key for all of its torchrun blocks)
RUN_BY_TEST_FRAMEWORKS = {("docs/frameworks.md", "torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.")}

_FENCE = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<language>[^\n]*)$\n", re.MULTILINE),
                                 mapping={"language": "language", "source": "source"})


def _fenced_blocks(document):
    """Sybil's parser: every fenced block, tagged or not, as (language, source)."""
    for region in _FENCE(document):
        region.parsed = (region.lexemes["language"].strip(), str(region.lexemes["source"]))
        yield region


def _blocks() -> dict[str, tuple[str, str, str]]:
    """Every fenced block of DOCUMENTS, named "document:line": (document, language, source)."""
    sybil = Sybil(parsers=[_fenced_blocks])
    blocks = {}
    for name in DOCUMENTS:
        for example in sybil.parse(harness.ROOT / name):
            language, source = example.parsed
            blocks[f"{name}:{example.line}"] = (name, language, source)
    return blocks


BLOCKS = _blocks()


def _named(table) -> dict[str, tuple]:
    """The blocks ``table`` names: "document:line" -> its key."""
    return {where: key for where, (name, _, source) in BLOCKS.items() for key in table
            if key[0] == name and key[1] in source}


def _python_scripts() -> dict[str, str]:
    """Each distinct ```python block not in NOT_RUN, named by every place it appears."""
    skipped = _named(NOT_RUN)
    places: dict[str, list[str]] = {}
    for where, (_, language, source) in BLOCKS.items():
        if language == "python" and where not in skipped:
            places.setdefault(source, []).append(where)
    return {"+".join(wheres): source for source, wheres in places.items()}


def test_every_block_is_run_or_has_a_reason_not_to_be():
    tables = {"NOT_RUN": NOT_RUN, "RUN": RUN, "RUN_BY_TEST_FRAMEWORKS": RUN_BY_TEST_FRAMEWORKS}
    claims: dict[str, list[str]] = {}
    for table_name, table in tables.items():
        for document, substring in table:
            named = [where for where, (name, _, source) in BLOCKS.items() if name == document and substring in source]
            assert named, f"{table_name} names a block that {document} no longer has: {substring!r}"
            for where in named:
                claims.setdefault(where, []).append(f"{table_name}[{substring!r}]")
    for where, (_, language, source) in BLOCKS.items():
        if language == "python" and where not in claims:
            claims[where] = ["a Python script, run on 2 ranks"]
        assert claims.get(where), (
            f"{where}: a new block that is neither run nor skipped with a reason: add it to NOT_RUN, RUN or "
            f"RUN_BY_TEST_FRAMEWORKS in tests/test_docs.py:\n{source}")
        assert len(claims[where]) == 1, f"{where} is named more than once: {claims[where]}"


@tiers.FULL_ONLY
@pytest.mark.parametrize("where", list(_python_scripts()))
def test_python_block_runs_on_two_cpu_ranks_without_a_warning(tmp_path, where):
    """The compiled-step example built a GradScaler("cuda"), which warns on a CPU machine."""
    script = tmp_path / "example.py"
    script.write_text("import warnings\nwarnings.simplefilter('error')\n" + _python_scripts()[where])
    run = harness.torchrun([str(script)], cwd=tmp_path, python_flags=("-W", "error"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Warning" not in run.stderr, run.stderr


def _bash(source: str, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``bash -c source`` as a user of this environment runs it: its python and torchrun first on
    PATH, no variables of this test session; on timeout the whole process group is killed."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    run = harness.run_as_user(["bash", "-c", source], cwd=cwd, timeout=timeout, env={"PATH": path})
    assert run.returncode == 0, f"{source}\nexit status {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run


def _block(document: str, substring: str) -> str:
    (source,) = [s for name, _, s in BLOCKS.values() if name == document and substring in s]
    return source


def _quick_start(source: str, tmp_path) -> None:
    """the torchrun command after `pip install ... &&` (what .ci/run installs), from the checkout,
    the launcher's warnings as errors and no warning printed"""
    command = next(line for line in source.splitlines() if "&& torchrun " in line)
    launch = shlex.split(command.split("&& torchrun ", 1)[1])
    assert launch[:3] == ["--standalone", "--nproc-per-node", "2"], command
    run = harness.torchrun(launch[3:], cwd=harness.ROOT, python_flags=("-W", "error"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Warning" not in run.stderr, run.stderr


def _from_the_checkout(source: str, tmp_path) -> None:
    """through bash, from the checkout; it must print something (the grep finds its assignments)"""
    assert _bash(source, harness.ROOT, timeout=60).stdout.strip(), source


def _stored_sweep_line(source: str, tmp_path) -> None:
    """only its last line, the cost model on a stored sweep, through bash from the checkout: the
    other lines simulate hosts, which needs root (network namespaces, veth, tc) and minutes a run"""
    (line,) = [line for line in source.splitlines() if "benchmarks/results/" in line]
    assert _bash(line, harness.ROOT, timeout=120).stdout.strip(), line


def _launcher(source: str, tmp_path) -> None:
    """through bash as written (4 ranks), in an empty folder whose train.py is docs/surviving.md's
    first script"""
    (tmp_path / "train.py").write_text(_block("docs/surviving.md", "in place of smddp_lite.init()"))
    _bash(source, tmp_path, timeout=300)


# (document, a substring unique to the block there) -> (how it runs, in the quick tier too)
RUN = {
    ("README.md", "torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.train_ddp"): (_quick_start, True),
    ("docs/architecture.md", 'grep -rnE "^\\s+[A-Za-z_]+'): (_from_the_checkout, True),
    ("docs/clusters.md", "python -m benchmarks.scaling --rate"): (_stored_sweep_line, False),
    ("docs/surviving.md", "python -m smddp_lite.launch --nproc-per-node 4"): (_launcher, False),
}


def _command_params():
    """RUN's blocks, the README's quick start first (the quick tier's first case)."""
    params = [pytest.param(where, key, id=where, marks=tiers.QUICK if RUN[key][1] else tiers.FULL_ONLY)
              for where, key in _named(RUN).items()]
    return sorted(params, key=lambda p: RUN[p.values[1]][0] is not _quick_start)


@pytest.mark.parametrize("where, key", _command_params())
def test_command_block_runs(tmp_path, where, key):
    RUN[key][0](BLOCKS[where][2], tmp_path)


@tiers.QUICK
@pytest.mark.parametrize("where", list(_named(RUN_BY_TEST_FRAMEWORKS)))
def test_framework_command_is_the_one_test_frameworks_runs(where):
    from . import test_frameworks

    source = BLOCKS[where][2].strip()
    prefix = "torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples."
    assert source.startswith(prefix) and "\n" not in source, source
    example, *flags = source[len(prefix):].split()
    assert example in test_frameworks.EXAMPLES or example in test_frameworks.COMPILED_STEP_EXAMPLES, \
        f"{where}: tests/test_frameworks.py does not run {example}"
    if flags:  # its other tests run the compiled ones with --compile, and the compiled step's routes
        assert (flags == ["--compile"] and example in test_frameworks.COMPILED
                or flags == ["--compiled-step"] and example in test_frameworks.COMPILED_STEP), \
            f"{where}: not run as {source}"


@tiers.QUICK
@pytest.mark.parametrize("where", list(_named(NOT_RUN)))
def test_block_not_run_here(where):
    pytest.skip(f"{where}: {NOT_RUN[_named(NOT_RUN)[where]]}")


def test_every_smddp_variable_the_documents_name_is_known():
    from smddp_lite.config import read_env

    names = set()
    for name in DOCUMENTS:
        names.update(re.findall(r"SMDDP_[A-Z0-9_]+\*?", (harness.ROOT / name).read_text()))
    names = {n for n in names if not n.endswith("*")}  # SMDDP_INTER_NODE_*: a family, named in full elsewhere
    names.discard("SMDDP_TRANSPRT")  # the misspelling of read_env's docstring, refused below
    assert len(names) > 20, names
    for name in sorted(names):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # AWS's own variables warn that they do nothing here
            try:
                read_env("backend", {name: "1"})
            except ValueError as error:  # a value "1" may be refused; the name may not
                assert "unknown environment variable" not in str(error), f"{name}: {error}"
    with pytest.raises(ValueError, match="unknown environment variable SMDDP_TRANSPRT"):
        read_env("backend", {"SMDDP_TRANSPRT": "shm"})
