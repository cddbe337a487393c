"""Access to the agent's socket, over a real process: with `socket_group` set, a user in that group may talk
to the API and a user outside it is refused by the kernel (the socket is 0660, owned by the group). The other
access checks of the suite live with their subjects: the broker ACL (tests/agent/test_mqtt_access.py::
test_the_acl_keeps_each_device_to_its_own_topics) and signed updates (tests/agent/test_update_*.py)."""
from __future__ import annotations

import grp
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from processes import Agent

GROUP = "operator"  # a stock Debian group the `nobody` user is not in
NOBODY = 65534

# Run as another user by the system's Python, not this virtualenv's (which that user may not be able to read).
PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused"); sys.exit(0)
s.sendall(b"GET /health HTTP/1.0\\r\\nHost: agent\\r\\n\\r\\n")
print(s.recv(4096).split(b"\\r\\n")[0].decode())
"""



def probe(sock: Path, extra_groups: list[int]) -> str:
    return subprocess.run(["/usr/bin/python3", "-c", PROBE, str(sock)], user=NOBODY, group=NOBODY,
                          extra_groups=extra_groups, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another user needs root")
def test_the_socket_admits_its_group_and_refuses_everyone_else(tiny_fp32_bundle, tmp_path, figures):
    # The socket's directory must be searchable by the other user, or the refusal would prove nothing.
    public = Path(tempfile.mkdtemp(prefix="edge-access-", dir="/tmp"))
    public.chmod(0o755)
    config = tmp_path / "agent.toml"
    config.write_text(f'[api]\nsocket_group = "{GROUP}"\n')
    agent = Agent(tmp_path, "--model", tiny_fp32_bundle.path, "--config", config, "--memory-budget-mb", 2048)
    agent.sock = public / "agent.sock"
    try:
        agent.start()
        st = agent.sock.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam(GROUP).gr_gid
        assert probe(agent.sock, extra_groups=[]) == "refused"
        assert probe(agent.sock, extra_groups=[grp.getgrnam(GROUP).gr_gid]) == "HTTP/1.1 200 OK"
        figures.append(f"access: socket 0660 group {GROUP}; uid {NOBODY} outside the group refused, "
                       f"the same uid in the group answered 200")
    finally:
        agent.stop()
        shutil.rmtree(public, ignore_errors=True)
