"""The in-sandbox side of atoll: the guest agent (`agent.py`) that runs as PID 1 in every gVisor sandbox.

`agent.py` is a standalone, standard-library-only script: the image build copies it to
/opt/atoll/agent.py and the sandbox starts it as `python3 /opt/atoll/agent.py --port 49999`. The
worker on the host is its only client. Nothing in atoll imports it at runtime (tests load it to
exercise its pure helpers).
"""
