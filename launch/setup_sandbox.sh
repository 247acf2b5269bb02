#!/usr/bin/env bash
# Sets up the code-execution sandbox of rl/rewards/sandbox.py on Debian/Ubuntu. Idempotent.
# Run as root: `bash launch/setup_sandbox.sh`. It
#   1. installs bubblewrap (and python3, util-linux's prlimit) with apt-get when missing;
#   2. creates the system user `seedrl-sandbox` (no home, no login shell) that sandboxed
#      programs run as: the kernel ignores RLIMIT_NPROC for root, so fork bombs are only
#      bounded for a non-root user;
#   3. checks that bwrap can build a sandbox as that user (needs unprivileged user namespaces)
#      and that the machine is one the sandbox's seccomp filter knows (x86_64, aarch64);
#   4. creates the parent cgroups (seedrl-sandbox) under which each run gets a cgroup bounding
#      its memory and tasks as a whole, and reports when cgroups cannot be used here (in most
#      containers): then the sandbox warns and bounds memory per process only
#      (docs/security.md). rl/rewards/sandbox.py also does this itself when it first runs,
#      since cgroups do not survive a reboot.
# As a non-root user it only reports what is missing (and exits 0 so that launch/setup.sh
# still completes); rl/rewards/sandbox.py then refuses to run code until it is fixed.
set -euo pipefail

SANDBOX_USER=seedrl-sandbox  # must match SANDBOX_USER in rl/rewards/sandbox.py

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ -x /usr/bin/python3 ] || missing+=(python3)
[ -x /usr/bin/prlimit ] || missing+=(util-linux)

if [ "$(id -u)" -ne 0 ]; then
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup_sandbox: not root; missing packages: ${missing[*]}." >&2
    echo "setup_sandbox: run 'sudo bash launch/setup_sandbox.sh' to enable the code sandbox." >&2
  else
    echo "setup_sandbox: not root; bubblewrap present, programs will run as $(id -un)."
  fi
  exit 0
fi

if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup_sandbox: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! id -u "$SANDBOX_USER" >/dev/null 2>&1; then
  echo "setup_sandbox: creating system user $SANDBOX_USER"
  useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin "$SANDBOX_USER"
fi

# The sandbox runs bwrap as the unprivileged user, which needs user namespaces.
if ! setpriv --reuid="$SANDBOX_USER" --regid="$SANDBOX_USER" --clear-groups \
    bwrap --unshare-all --unshare-user --ro-bind /usr /usr --symlink usr/lib /lib \
    --symlink usr/lib64 /lib64 --symlink usr/bin /bin -- /usr/bin/true; then
  echo "setup_sandbox: bwrap cannot create namespaces as $SANDBOX_USER; enable unprivileged" \
    "user namespaces (sysctl kernel.unprivileged_userns_clone=1, or" \
    "user.max_user_namespaces > 0; in a container, allow them in its seccomp profile)." >&2
  exit 1
fi
case "$(uname -m)" in
  x86_64|aarch64) ;;
  *) echo "setup_sandbox: no seccomp filter for $(uname -m) (only x86_64, aarch64);" \
       "rl/rewards/sandbox.py will refuse to run code." >&2
     exit 1 ;;
esac

limits=$(cd "$(dirname "$0")/.." && /usr/bin/python3 rl/rewards/sandbox_cgroup.py)
echo "setup_sandbox: ok (bwrap $(bwrap --version | cut -d' ' -f2), user $SANDBOX_USER, $limits)"
