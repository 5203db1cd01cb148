"""Pure parts of environment building: detection, install proposals, snapshots."""

import io
import tarfile

import pytest

from coderl.agent.buildpolicy import BUILDERS, get_builder
from coderl.envbuild.build import RuleBasedPolicy, read_license
from coderl.envbuild.detect import detect, propose_install_plans
from coderl.tasks.snapshot import parse_spec, snapshot_dir, tree_digest, unpack


def make_repo(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


SRC_LAYOUT = {
    "pyproject.toml": (
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "minilib"\n[project.optional-dependencies]\ntest = ["pytest"]\n'
        '[tool.pytest.ini_options]\naddopts = "--cov=minilib"\n'
    ),
    "src/minilib/__init__.py": "def add(a, b):\n    return a + b\n",
    "tests/__init__.py": "",
    "tests/test_add.py": (
        "import yaml\nimport minilib\nimport os\nfrom tests import helpers\n"
        "try:\n    import hypothesis\nexcept ImportError:\n    hypothesis = None\n"
        "def test_add():\n    assert minilib.add(1, 2) == 3\n"
    ),
    "tests/helpers.py": "",
    "requirements-test.txt": "pytest\n",
    "requirements.txt": "attrs\n",
    "tox.ini": "[testenv]\ndeps =\n    pytest\n    mock\ncommands = pytest\n",
    "PKG-INFO": "Metadata-Version: 2.1\nName: minilib\nLicense: BSD-3-Clause\n",
}


def test_detect_src_layout(tmp_path):
    info = detect(make_repo(tmp_path, SRC_LAYOUT))
    assert info.build_files == ["pyproject.toml"]
    assert info.build_backend == "hatchling.build"
    assert (info.source_root, info.top_level) == ("src", ["minilib"])
    assert info.test_dirs == ["tests"]
    assert info.test_extras == ["test"]
    # test files first; the rest after
    assert info.requirement_files == ["requirements-test.txt", "requirements.txt"]
    assert info.tox_deps == ["pytest", "mock"]
    # module-level third-party imports only: yaml -> pyyaml; hypothesis is optional (in try),
    # os is stdlib, minilib is the project, tests is local
    assert info.test_imports == ["pyyaml"]
    assert info.pytest_config == "pyproject.toml" and info.needs_pytest_cov
    assert read_license(tmp_path) == "BSD-3-Clause"


def test_a_conftest_using_pytest_covs_marker_gets_pytest_cov(tmp_path):
    # python-dateutil: its conftest adds pytest.mark.no_cover, registered only by pytest-cov,
    # and its `filterwarnings = error` turns the unknown mark into an error without it
    files = {
        "setup.cfg": "[tool:pytest]\nfilterwarnings =\n    error\n",
        "mini.py": "X = 1\n",
        "tests/test_x.py": "def test_x():\n    pass\n",
        "tests/conftest.py": "import pytest\n",
    }
    assert not detect(make_repo(tmp_path / "a", files)).needs_pytest_cov
    files["tests/conftest.py"] += "def f(item):\n    item.add_marker(pytest.mark.no_cover)\n"
    info = detect(make_repo(tmp_path / "b", files))
    assert info.needs_pytest_cov
    assert "'pytest-cov'" in propose_install_plans(info)[0].commands[0]
    # wcwidth: `--cov` in tox.ini's [pytest] addopts
    tox = {"tox.ini": "[pytest]\naddopts = --doctest-modules\n    --cov=mini\n", **files}
    tox["tests/conftest.py"] = "import pytest\n"
    assert detect(make_repo(tmp_path / "c", tox)).needs_pytest_cov


def test_install_plans_are_ordered_unique_and_bounded(tmp_path):
    info = detect(make_repo(tmp_path, SRC_LAYOUT))
    plans = propose_install_plans(info)
    names = [p.name for p in plans]
    assert names[:4] == [
        "project+extras",
        "project+test-imports",
        "project+requirements",
        "project+tox-deps",
    ]
    assert len(names) == len(set(names)) <= 10
    assert "'.[test]'" in plans[0].commands[0] and "'pytest-cov'" in plans[0].commands[0]
    assert all("pytest" in " ".join(p.commands) for p in plans)
    assert len(propose_install_plans(info, max_plans=3)) == 3


def test_detect_single_file_module_with_root_tests(tmp_path):
    repo = make_repo(
        tmp_path,
        {
            "setup.py": "from setuptools import setup\nsetup()\n",
            "six.py": "x = 1\n",
            "test_six.py": "import six\n",
            "setup.cfg": "[tool:pytest]\nminversion = 2.2\n",
        },
    )
    info = detect(repo)
    assert info.top_level == ["six"] and info.test_dirs == ["test_six.py"]
    assert info.pytest_config == "setup.cfg" and info.test_imports == []
    assert [p.name for p in propose_install_plans(info)][0] == "project+test-imports"


def test_rule_policy_proposes_each_plan_once_then_gives_up(tmp_path):
    info = detect(make_repo(tmp_path, SRC_LAYOUT))
    policy = get_builder("rules")
    attempts = []
    while (plan := policy.propose(info, attempts)) is not None:
        attempts.append({"plan": plan.name})
    assert [a["plan"] for a in attempts] == [p.name for p in propose_install_plans(info)]
    assert isinstance(policy, RuleBasedPolicy)
    with pytest.raises(KeyError, match="valid"):
        get_builder("llm")
    assert list(BUILDERS) == ["rules", "model"]


def test_snapshot_is_content_addressed(tmp_path):
    a = make_repo(
        tmp_path / "a", {"x.py": "1\n", "pkg/y.py": "2\n", "pkg/__pycache__/y.pyc": "junk"}
    )
    b = make_repo(tmp_path / "b", {"x.py": "1\n", "pkg/y.py": "2\n"})
    c = make_repo(tmp_path / "c", {"x.py": "1\n", "pkg/y.py": "3\n"})
    # caches are not content: a and b are the same snapshot; c differs by one byte
    assert tree_digest(a) == tree_digest(b) != tree_digest(c)
    digest, snap = snapshot_dir(a, cache=tmp_path / "cache")
    again, snap2 = snapshot_dir(b, cache=tmp_path / "cache")
    assert (digest, snap) == (again, snap2) and snap.name == digest[:16]
    assert (snap / "pkg/y.py").read_text() == "2\n" and not (snap / "pkg/__pycache__").exists()
    assert oct(snap.stat().st_mode & 0o777) == "0o755"


def test_unpack_refuses_path_traversal(tmp_path):
    archive = tmp_path / "evil-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(tarfile.TarError):
        unpack(archive, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_parse_spec():
    assert parse_spec("toolz==1.0.0") == ("toolz", "1.0.0")
    assert parse_spec("python-dateutil==2.9.0.post0") == ("python-dateutil", "2.9.0.post0")
    assert parse_spec("./some/path") is None and parse_spec("toolz>=1") is None


def test_unbuildable_repositories_say_which_step_failed(tmp_path):
    from coderl.envbuild.build import BuildError, build_env

    with pytest.raises(BuildError) as err:
        build_env(str(tmp_path / "missing"), cache=tmp_path / "cache")
    assert (
        err.value.step == "download" and "neither NAME==VERSION nor a directory" in err.value.error
    )
    no_tests = make_repo(tmp_path / "no-tests", {"setup.py": "", "pkg/__init__.py": ""})
    with pytest.raises(BuildError) as err:
        build_env(str(no_tests), cache=tmp_path / "cache", factory=lambda *a, **k: None)
    assert err.value.step == "explore" and "no test" in err.value.error


def test_the_cache_root_resolves_a_linked_cache(tmp_path, monkeypatch):
    """Environments record absolute paths: a checkout whose data/cache links to a shared cache
    records the shared paths, which outlive the checkout."""
    from coderl.tasks.snapshot import cache_dir

    shared = tmp_path / "shared-cache"
    shared.mkdir()
    checkout = tmp_path / "checkout"
    (checkout / "data").mkdir(parents=True)
    (checkout / "data" / "cache").symlink_to(shared)
    import coderl.tasks.snapshot as snapshot

    monkeypatch.setattr(snapshot, "CHECKOUT_DATA", checkout / "data")
    monkeypatch.chdir(tmp_path)  # elsewhere: the checkout's cache, not the working directory's
    monkeypatch.delenv("CODERL_CACHE", raising=False)
    assert cache_dir() == shared.resolve()
    monkeypatch.setenv("CODERL_CACHE", "")  # empty is unset, not the working directory
    assert cache_dir() == shared.resolve()
    assert not (tmp_path / "data").exists()
    monkeypatch.setattr(snapshot, "CHECKOUT_DATA", tmp_path / "installed" / "data")
    assert cache_dir() == (tmp_path / "data" / "cache").resolve()  # no checkout: ./data/cache


def test_a_command_run_outside_the_checkout_finds_the_checkouts_environments(monkeypatch, tmp_path):
    """A new user's ``coderl eval`` from another directory found the tasks (read from the
    checkout) and no built environment (the cache was looked up under the working directory)."""
    from coderl.tasks.repos import DATA_DIR
    from coderl.tasks.snapshot import cache_dir

    monkeypatch.delenv("CODERL_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cache_dir() == (DATA_DIR / "cache").resolve()
    assert not (tmp_path / "data").exists()


def _build_in_child(spec, cache, log):
    """Child process: ``build_env`` with ``_build`` replaced by a slow fake that logs each call."""
    import time

    import coderl.envbuild.build as build
    from coderl.tasks.env import EnvRecord

    def slow_build(spec, factory, cache, policy):
        with open(log, "a") as f:
            f.write("build\n")
        time.sleep(0.5)  # the window in which a second, unlocked builder would start its own
        env_dir = cache / "envs" / "fake-1.0-000000000000"
        (env_dir / "venv").mkdir(parents=True)
        record = EnvRecord(
            env_id=env_dir.name,
            spec=spec,
            name="fake",
            version="1.0",
            snapshot_digest="0",
            snapshot=str(cache),
            venv=str(env_dir / "venv"),
            install_plan="none",
            install_commands=[],
            test_paths=[],
            test_command="pytest",
            passing=[],
        )
        record.save(env_dir / "env.json")
        return record

    build._build = slow_build
    print(build.build_env(spec, cache=cache).env_id, file=open(log.with_suffix(".out"), "a"))


def test_two_processes_building_one_spec_build_it_once(tmp_path):
    """Two pytest-xdist workers on a fresh cache once both built ``six`` and the second's rename
    onto the first's venv failed (``Directory not empty``): the build is serialised per spec."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    log = tmp_path / "calls.log"
    children = [
        ctx.Process(target=_build_in_child, args=("fake==1.0", tmp_path / "cache", log))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0, 0]
    assert log.read_text() == "build\n"
    assert log.with_suffix(".out").read_text().split() == ["fake-1.0-000000000000"] * 2
