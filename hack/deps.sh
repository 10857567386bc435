#!/usr/bin/env bash
# Install the Debian packages the README's commands need, by the command (or file) each provides.
#
#   hack/deps.sh demo    what `make demo` needs (openssl, chattr, ...)
#   hack/deps.sh test    what `make test` needs: the demo's, plus the real node's (containerd, runc, the CNI
#                        plugins, socat), the image build's (mmdebstrap, buildah) and strace (the calls the
#                        agent makes, against its seccomp profile) and rsync (a peer of the delete benchmark)
#
# As root it runs apt-get for what is missing (once `apt-get update`); otherwise it names the packages
# and fails. Quiet when everything is there.
set -euo pipefail

demo=(openssl:openssl chattr:e2fsprogs setpriv:util-linux unshare:util-linux nsenter:util-linux make:make)
test=(shellcheck:shellcheck useradd:passwd containerd:containerd ctr:containerd runc:runc socat:socat
	ip:iproute2 cc:gcc /usr/lib/cni/bridge:containernetworking-plugins mmdebstrap:mmdebstrap buildah:buildah
	strace:strace rsync:rsync)

case ${1:-test} in
demo) want=("${demo[@]}") ;;
test) want=("${demo[@]}" "${test[@]}") ;;
*)
	echo "usage: $0 demo|test" >&2
	exit 2
	;;
esac

need=()
for pair in "${want[@]}"; do
	what=${pair%%:*} pkg=${pair##*:}
	if [[ $what == /* ]]; then [[ -e $what ]] && continue; else command -v "$what" >/dev/null 2>&1 && continue; fi
	[[ " ${need[*]} " == *" $pkg "* ]] || need+=("$pkg")
done
((${#need[@]})) || exit 0
if ((EUID != 0)); then
	echo "deps: install these Debian packages first (as root): apt-get install ${need[*]}" >&2
	exit 1
fi
echo "[deps] installing Debian packages: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
