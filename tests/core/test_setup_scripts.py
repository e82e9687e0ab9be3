"""The set-up scripts a newcomer runs first: every long step is announced with its
usual duration (no silent minutes), a finished set-up is recognised by a stamp
(idempotent without reinstalling), and the README states what they cost."""
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ["scripts/setup.sh", "scripts/setup-engines.sh", "scripts/engines/vllm.sh", "scripts/engines/sglang.sh"]
INSTALLERS = ["scripts/setup.sh", "scripts/engines/vllm.sh", "scripts/engines/sglang.sh"]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", INSTALLERS)
def test_every_pip_call_runs_inside_an_announced_step(script):
    lines = (ROOT / script).read_text().splitlines()
    open_step = None
    pips = 0
    for n, line in enumerate(lines, 1):
        code = "" if line.lstrip().startswith("#") else line
        if re.match(r"\s*step ", code):
            assert open_step is None, f"{script}:{n}: a step starts before step {open_step} is done"
            m = re.match(r'\s*step "(?:[^"\\]|\\.)+" "([^"]+)"', code)
            said = [m.group(1)] if m else []
            if said and said[0].startswith("$"):  # a variable: every value the script gives it
                said = re.findall(rf'\b{said[0][1:]}="([^"]*)"', "\n".join(lines))
            assert said and all(re.search(r"\d\s*(s|min)\b", d) for d in said), \
                f"{script}:{n}: no duration in {line!r}"
            open_step = n
        elif re.match(r"\s*step_done\b", code):
            assert open_step is not None, f"{script}:{n}: step_done without a step"
            open_step = None
        if re.search(r"\bpip(_loud|_quiet)? install|-m pip .*(install|download)", code):
            pips += 1
            assert open_step is not None, f"{script}:{n}: pip outside an announced step: {line.strip()}"
        assert "$PIP " not in code, f"{script}:{n}: the old quiet-everywhere $PIP"
    assert pips and open_step is None


@pytest.mark.parametrize("script", INSTALLERS)
def test_a_finished_setup_is_skipped_by_its_stamp(script):
    text = (ROOT / script).read_text()
    check = text.index('if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]')
    assert check < text.index("\nstep ") and "exit 0" in text[check:text.index("\nfi\n", check)]
    assert text.rindex('echo "$want" > "$STAMP"') > text.rindex("step_done")  # written when all is done
    head = " ".join(w for w in text.split("set -euo pipefail")[0].split() if w != "#")
    assert "a second" in head  # the header says what a re-run costs


def test_long_installs_show_pip_output():
    for script in INSTALLERS:
        for line in (ROOT / script).read_text().splitlines():
            if line.lstrip().startswith("#"):
                continue
            if re.search(r"torch|IMPORT_DEPS|REQS|vllm==|\$SGLANG", line) and "install" in line and "pip" in line:
                assert "pip_loud" in line, f"{script}: a long install runs quietly: {line.strip()}"


def test_step_helper_prints_the_step_its_duration_and_how_long_it_took():
    r = subprocess.run(["bash", "-c", "source scripts/steps.sh; SETUP_TAG=t; step 'fetch x' '1-2 min'; step_done"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"==> t: fetch x \(usually 1-2 min\)\n    done in \d+s\n", r.stdout), r.stdout


def test_readme_says_to_install_from_the_checkout_and_what_set_up_costs():
    assert not re.search(r'pip install "hicache\[', README.replace('so `pip install "hicache[vllm]"` finds', ""))
    assert 'pip install -e ".[vllm]"' in README and 'pip install -e ".[sglang]"' in README
    assert re.search(r"\d+(\.\d)? GB for the three environments", README)
    for script in ("scripts/setup.sh", "scripts/setup-engines.sh"):
        head = (ROOT / script).read_text().split("set -euo pipefail")[0]
        assert re.search(r"\d+(\.\d)? GB", head), f"{script}: its header states no disk need"


def test_readme_test_counts_are_ranges_or_dated():
    """Exact suite counts go stale with every merge: each one stands next to a date."""
    for para in README.split("\n\n"):
        for m in re.finditer(r"\b[\d,]+ passed", para):
            assert re.search(r"20\d\d-\d\d-\d\d", para), f"an undated suite count: {m.group(0)!r} in\n{para}"
