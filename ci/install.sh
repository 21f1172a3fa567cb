# Sourced by ci/setup.sh and ci/setup-verl.sh. `install VENV ARGS...` is `pip install -q ARGS` into the virtual
# environment VENV, run by uv once `use_uv` could install it (uv resolves, downloads and unpacks several times
# faster than pip, which spent most of the set-up's minutes there), else by VENV's own pip.
#
# uv must install what pip would. It reads no pip configuration, so it is handed pip's own (`pip config list`:
# find-links, index-url, extra-index-url, constraint; on this machine the local CPU torch wheel, two local indexes
# and the torch cap) and pip's way of choosing: the best version and, of that version, the best wheel for this
# machine among every index's files. uv's unsafe-best-match does the first, but takes a version's files from the
# first index that has it (a local index's py310 wheel of multiprocess, where pip takes another's py311 one); a
# local (file://) extra index is therefore handed to uv as one flat page of its files (`flat_page`), whose files
# uv weighs with the registry's. uv compiles no bytecode as it installs, where pip does: `compile_venv` does it at
# the end (with PYTHONDONTWRITEBYTECODE=1, as on this machine, a venv without it recompiles torch and vLLM in
# every process: `import vllm, torch, transformers` took 37 s instead of 14 s on a busy 2-core machine).
UV_VERSION=0.13.9
UV_HOME=.cache/uv       # uv, installed there with --target: in neither venv
UV="$UV_HOME/bin/uv"
INSTALLER=pip           # use_uv makes it uv
UV_OPTIONS=()           # pip's configuration, as uv options (use_uv)

have_uv() { [ "$("$UV" --version 2>/dev/null | cut -d' ' -f1-2)" = "uv $UV_VERSION" ]; }

use_uv() {  # VENV: install uv with VENV's pip and use it from now on; without it (no network, ...) pip stays
  have_uv || "$1/bin/pip" install -q --no-deps --upgrade --target "$UV_HOME" "uv==$UV_VERSION" >&2 || true
  if ! have_uv; then
    echo "ci/install.sh: uv $UV_VERSION could not be installed; installing with pip (slower)" >&2
    return 0
  fi
  INSTALLER=uv
  local listing value
  listing=$("$1/bin/pip" config list 2>/dev/null) || listing=""
  UV_OPTIONS=(--index-strategy unsafe-best-match)  # as pip: the best version in any index
  value=$(pip_setting "$listing" index-url) && UV_OPTIONS+=(--index-url "$value")
  for value in $(pip_setting "$listing" extra-index-url); do
    case "$value" in
      file://*) UV_OPTIONS+=(--find-links "$(flat_page "$value")") ;;
      *) UV_OPTIONS+=(--extra-index-url "$value") ;;
    esac
  done
  for value in $(pip_setting "$listing" find-links); do UV_OPTIONS+=(--find-links "$value"); done
  for value in $(pip_setting "$listing" constraint); do UV_OPTIONS+=(-c "$value"); done
  value=$(pip_setting "$listing" default-timeout) && export UV_HTTP_TIMEOUT="$value"
  return 0
}

pip_setting() {  # LISTING KEY: the value pip installs with (its PIP_* variable, else [install], else [global])
  local line section
  for section in ':env:' install global; do
    while IFS= read -r line; do
      [[ $line == "$section.$2="* ]] || continue
      line=${line#*=}; line=${line#\'}; echo "${line%\'}"
      return 0
    done <<<"$1"
  done
  return 1
}

flat_page() {  # FILE_URL: a page in .cache/ linking every file (with its hash) of the local simple index FILE_URL
  "${PYTHON:-python3}" - "$1" <<'PY'
import hashlib, os, re, sys
from urllib.parse import unquote, urlsplit
root = unquote(urlsplit(sys.argv[1]).path)
links = []
for project in sorted(os.listdir(root)):
    page = os.path.join(root, project, "index.html")
    if os.path.isfile(page):
        with open(page) as f:
            for href in re.findall(r'href="([^"]+)"', f.read()):
                path, _, fragment = unquote(href).partition("#")
                target = os.path.normpath(os.path.join(root, project, path))
                anchor = f"#{fragment}" if fragment else ""  # the file's hash, which uv checks as pip does
                links.append(f'<a href="file://{target}{anchor}">{os.path.basename(path)}</a>\n')
out = os.path.abspath(f".cache/uv-find-links/{hashlib.sha256(root.encode()).hexdigest()[:16]}.html")
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(f"{out}.{os.getpid()}", "w") as f:
    f.write("<html><body>\n" + "".join(links) + "</body></html>\n")
os.replace(f"{out}.{os.getpid()}", out)  # whole, for a set-up reading it meanwhile
print(f"file://{out}")
PY
}

install() {  # VENV ARGS...: pip install -q ARGS into VENV, by uv or pip
  local venv=$1 lock=(); shift
  # an editable install builds in the checkout (hwsync.egg-info/): one build at a time when both venvs are set up
  case " $* " in *" -e "*) mkdir -p .cache && lock=(flock .cache/editable-build.lock) ;; esac
  if [ "$INSTALLER" = uv ]; then
    "${lock[@]}" "$UV" pip install -q --python "$venv/bin/python" "${UV_OPTIONS[@]}" "$@"
  else
    "${lock[@]}" "$venv/bin/pip" install -q "$@"
  fi
}

compile_venv() {  # VENV [TWIN]: the bytecode pip would have written (uv writes none), one venv at a time
  # A source file that uv linked into both venvs from its cache (torch, most of the rest) is one file: its
  # bytecode compiled for TWIN is linked, not compiled again. Bytecode already up to date is kept.
  [ "$INSTALLER" = uv ] || return 0
  mkdir -p .cache
  flock .cache/compile.lock "$1/bin/python" - "${2:-}" <<'PY'
import compileall, os, sys, sysconfig
from importlib.util import cache_from_source

def link_twin_bytecode(site: str, twin_site: str) -> None:
    for folder, _, files in os.walk(site):
        for source in (os.path.join(folder, name) for name in files if name.endswith(".py")):
            twin_source = os.path.join(twin_site, os.path.relpath(source, site))
            try:  # the same file (inode) in both venvs has the same bytecode; compileall below checks it anyway
                if not os.path.exists(cache_from_source(source)) and os.path.samefile(source, twin_source):
                    os.makedirs(os.path.dirname(cache_from_source(source)), exist_ok=True)
                    os.link(cache_from_source(twin_source), cache_from_source(source))
            except OSError:
                pass  # not in the twin, another file there, or not compiled there: compiled below

for site in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
    if sys.argv[1]:
        link_twin_bytecode(site, os.path.join(sys.argv[1], os.path.relpath(site, sys.prefix)))
    compileall.compile_dir(site, quiet=2, workers=0)  # quiet: as pip, silent on files that are not Python 3
PY
}
