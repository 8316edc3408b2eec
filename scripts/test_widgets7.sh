#!/usr/bin/env bash
# Run the widget tests against ipywidgets 7.7.1, the version Colab's runtime ships.
#
# Builds .venv-widgets7 (git-ignored) as a full, separate virtual environment: the same pins as
# constraints.txt except ipywidgets 7.7.1 and its own widgetsnbextension/jupyterlab_widgets, so
# nothing from the main .venv (ipywidgets 8) can leak in. The first run installs (torch comes
# from the local wheel where there is one); later runs reuse the environment.
#
#   scripts/test_widgets7.sh            # build if needed, then run the widget tests
#   scripts/test_widgets7.sh -k stall   # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-widgets7
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    pins=$(mktemp)
    trap 'rm -f "$pins"' EXIT
    grep -v -E '^(ipywidgets|widgetsnbextension|jupyterlab[-_]widgets)==' constraints.txt > "$pins"
    printf 'ipywidgets==7.7.1\nwidgetsnbextension==3.6.1\njupyterlab-widgets==1.1.1\n' >> "$pins"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # The runtime and test dependencies only; JupyterLab/playwright (browser tests) need
    # ipywidgets 8's lab extension and are not installed here.
    "$VENV/bin/python" -m pip install -q -c "$pins" -e . pytest nbval jupyter_client \
        ipykernel ipywidgets==7.7.1 nbformat psutil pytest-timeout tqdm
fi
"$VENV/bin/python" - <<'PY'
import ipywidgets, sys
assert ipywidgets.__version__.startswith("7."), ipywidgets.__version__
assert "/.venv/" not in ipywidgets.__file__, ipywidgets.__file__
print(f"ipywidgets {ipywidgets.__version__} from {ipywidgets.__file__}", file=sys.stderr)
PY
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -o addopts="-ra" -W "ignore::DeprecationWarning" \
    tests/test_dashboard.py tests/test_config_panel.py tests/test_view_model.py "$@"
