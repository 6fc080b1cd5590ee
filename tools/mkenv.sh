#!/usr/bin/env bash
# Usage: tools/mkenv.sh LINK REQUIREMENTS
#
# Builds the dependencies of REQUIREMENTS once, in a cache outside the clone keyed by a hash of
# what they install, then makes LINK (e.g. .venv) a thin venv of this clone that sees them and
# holds an editable install of this package. A fresh clone then costs seconds, not a 7 GB download.
# The dependencies' commands (tensorboard, mlflow, wandb, ...) are put in LINK/bin too, so
# that `source LINK/bin/activate` puts them on the PATH beside `train`.
set -euo pipefail
link=$1 reqs=$2
py=${PYTHON:-python3.11}
cache=${LAUNCHER_ENV_CACHE:-$HOME/.cache/launcher/envs}
key=$( { "$py" -VV; cat "$reqs"; } | sha256sum | cut -c1-16)
name=$(basename "$link" | tr -d .)
deps="$cache/$name--$key"  # "--": no env's name is a prefix of another's

# pip's and setuptools' chatter only matters when something fails.
quietly() {
    local log
    log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "mkenv: failed: $*" >&2
        return 1
    fi
    rm -f "$log"
}

mkdir -p "$cache"
exec 9>"$deps.lock"
flock 9 # two clones building the same env wait for one another instead of racing
if [ ! -f "$deps/.complete" ]; then
    echo "mkenv: building $deps from $reqs (once per change of $reqs)"
    rm -rf "$deps"
    "$py" -m venv "$deps"
    quietly "$deps/bin/python" -m pip install --upgrade pip
    quietly "$deps/bin/python" -m pip install -r "$reqs"
    touch "$deps/.complete"
    # Keep the two newest builds of this environment: an older clone may still link to the
    # previous one, and each is gigabytes.
    ls -dt "$cache/$name"--*/ 2>/dev/null | tail -n +3 | while read -r old; do
        rm -rf "$old" "${old%/}.lock"
    done
fi

site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The editable install's entry points come from pyproject.toml: a change there is a new install.
stamp="$link/.deps-$key-$(sha256sum pyproject.toml | cut -c1-8)"
if [ ! -f "$stamp" ] || [ ! -x "$link/bin/python" ]; then
    rm -rf "$link"
    "$py" -m venv --without-pip "$link"
    own=$("$link/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$site')" > "$own/_launcher_deps.pth"
    quietly "$deps/bin/python" -m pip --python "$link/bin/python" install --no-deps \
        --no-build-isolation -e .
    touch "$stamp"
fi

# The dependencies' commands in the thin venv's bin, run by its python (which sees them and this
# package): a copy of each script with the venv's python in its first line, a link to a program
# that is not a script (ruff). The venv's own files (python, activate, train) are kept; pip is
# left out, as what it installed into the thin venv would go at its next rebuild. Run every
# time, cheaply, so that a venv built before this step gets them too.
bin=$(cd "$link/bin" && pwd)
marker="# mkenv.sh: a copy of"
for script in "$deps"/bin/*; do
    name=$(basename "$script")
    target="$bin/$name"
    case $name in python* | pip* | activate* | Activate.ps1) continue ;; esac
    [ -f "$script" ] || continue # a folder: __pycache__ of a script installed as a .py (jp.py)
    if [ -e "$target" ] || [ -L "$target" ]; then
        ours=$([ -L "$target" ] && readlink "$target" || sed -n 2p "$target")
        case $ours in "$deps/bin/"* | "$marker "*) ;; *) continue ;; esac  # the venv's own
    fi
    first=$(LC_ALL=C head -n 1 "$script" | tr -d '\0')
    if [ "$first" = "#!$deps/bin/python" ]; then
        { echo "#!$bin/python"; echo "$marker $script"; tail -n +2 "$script"; } >"$target.tmp"
        chmod +x "$target.tmp"
        mv -f "$target.tmp" "$target"
    else
        ln -sfn "$script" "$target"
    fi
done
