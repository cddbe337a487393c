#!/usr/bin/env bash
# Install the edge agent on an edge box: the package in its own virtual environment under /opt/edge-llm,
# the systemd units and snippets, the config, and a model bundle. Run as root from a checkout:
#   sudo systemd/install.sh --bundle bundles/smollm2-int4 [--fleet]     (PYTHON=/path/to/python3: another Python)
# Idempotent: rerunning upgrades the package and keeps an existing /etc/edge-agent/agent.toml.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
prefix=/opt/edge-llm
bundle=""
fleet=0
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) bundle="$2"; shift 2 ;;
        --fleet) fleet=1; shift ;;
        --prefix) prefix="$2"; shift 2 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
done

# The system's Python, not the first on PATH: a pyenv or conda one under /root or /home cannot be run by the
# service's user, nor under ProtectHome=yes (found in review). PYTHON=/path/to/python3 to choose another.
python="$(command -v "${PYTHON:-/usr/bin/python3}")" || { echo "no Python at ${PYTHON:-/usr/bin/python3}" >&2; exit 2; }
case "$(readlink -f "$python")" in
    /root/*|/home/*) echo "$python is under /root or /home: the service cannot run it; set PYTHON=" >&2; exit 2 ;;
esac

echo "==> package into $prefix/venv"
"$python" -m venv "$prefix/venv"
"$prefix/venv/bin/pip" install -q --upgrade pip
"$prefix/venv/bin/pip" install -q "$repo"
install -m 0644 "$repo/README.md" "$prefix/README.md"

echo "==> users, directories, units"
# /etc, not /usr/lib: /usr is read-only on some images, and the install stopped half done (found in review)
install -D -m 0644 "$repo/systemd/sysusers.d/edge-llm.conf" /etc/sysusers.d/edge-llm.conf
install -D -m 0644 "$repo/systemd/tmpfiles.d/edge-llm.conf" /etc/tmpfiles.d/edge-llm.conf
systemd-sysusers /etc/sysusers.d/edge-llm.conf
systemd-tmpfiles --create /etc/tmpfiles.d/edge-llm.conf
install -m 0644 "$repo/systemd/edge-agent.service" /etc/systemd/system/edge-agent.service
# owned by the agent's user: the service runs with Group=edge-llm-clients (its socket's group), whose members
# must not read a config that may hold the broker password; ProtectSystem=strict keeps it read-only to the agent
[ -f /etc/edge-agent/agent.toml ] || install -m 0600 -o edge-agent -g root "$repo/systemd/agent.toml" /etc/edge-agent/agent.toml
if [ "$fleet" = 1 ]; then
    install -m 0644 "$repo/systemd/edge-fleet.service" /etc/systemd/system/edge-fleet.service
    [ -f /etc/edge-fleet/fleet.env ] || install -m 0640 -g edge-fleet "$repo/systemd/fleet.env" /etc/edge-fleet/fleet.env
fi

if [ -n "$bundle" ]; then
    echo "==> model bundle $bundle"
    "$prefix/venv/bin/edge-quantize" inspect "$bundle" >/dev/null  # verifies every file's hash first
    name="$(basename "$bundle")"
    tmp="/var/lib/edge-agent/models/.$name.tmp"
    rm -rf "$tmp"  # an interrupted run's: cp would copy into it, and the bundle installed was a folder inside
    cp -a "$bundle" "$tmp"
    "$prefix/venv/bin/edge-quantize" inspect "$tmp" >/dev/null  # the copy, before it replaces anything
    sync -f "$tmp"  # the data on disk before a name points at it (power cuts)
    rm -rf "/var/lib/edge-agent/models/$name"
    mv "$tmp" "/var/lib/edge-agent/models/$name"
    ln -sfn "models/$name" /var/lib/edge-agent/current.tmp && mv -T /var/lib/edge-agent/current.tmp /var/lib/edge-agent/current
    chown -R edge-agent:edge-llm-clients /var/lib/edge-agent  # as StateDirectory= sets it (mode 0700)
    sync -f /var/lib/edge-agent  # the renames and the link too: a box that loses power now still boots
fi

"$prefix/venv/bin/edge-agent" check-config --config /etc/edge-agent/agent.toml
systemctl daemon-reload
# restart, not enable --now: rerun to upgrade, a running service kept the old code (found in review)
systemctl enable edge-agent.service
systemctl restart edge-agent.service
if [ "$fleet" = 1 ]; then
    systemctl enable edge-fleet.service
    systemctl restart edge-fleet.service
fi
echo "installed: systemctl status edge-agent"
