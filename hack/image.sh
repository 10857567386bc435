#!/usr/bin/env bash
# Build the sandkeep image from the repository's Dockerfile with no Docker engine and no registry, and
# leave it as a docker archive that `ctr -n k8s.io images import` (or `docker load`) reads.
#
#   hack/image.sh          # = make image; prints two lines on stdout: the archive path, the image reference
#
# First hack/protos.sh generates the CSI plugin's gRPC modules into controller/csi/proto/ (git-ignored; instant
# when generated): the build context is controller/, the build pip-installs it, and the hash below covers them.
#
# How, since there is no registry to pull the Dockerfile's python:3.11-slim-bookworm from:
#   1. mmdebstrap a Debian bookworm rootfs with Python 3.11 (Debian's python3 is 3.11, as in the slim
#      image) and import it into buildah's storage as localhost/sandkeep-python:<hash> (cached);
#   2. `buildah bud --build-arg PYTHON_IMAGE=<that image>` of the Dockerfile. The host's CA bundle and a
#      pip.conf naming it are bind-mounted read-only into the build's RUN steps only, as root's home (a
#      TLS-intercepting proxy in front of PyPI is then trusted; nothing of them lands in the image);
#   3. check the image as the chart runs it: read-only root, the controller as uid 65532, the agent as root;
#   4. `buildah push` it to a docker archive.
# Everything lives under $SANDKEEP_TOOLS_DIR/image (default .cache/tools/image): buildah's storage, the
# base rootfs tarball and sandkeep-<hash>.tar, keyed by a hash of every input (the build context as
# .dockerignore selects it, the Dockerfile, this script, the base recipe). An unchanged tree is not rebuilt.
# Needs root (buildah's storage, mmdebstrap's chroot); installs mmdebstrap and buildah with apt-get when
# they are missing.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${SANDKEEP_TOOLS_DIR:-$repo/.cache/tools}/image
ca_bundle=${SANDKEEP_IMAGE_CA:-/etc/ssl/certs/ca-certificates.crt}
mirror=${SANDKEEP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${SANDKEEP_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
suite=bookworm
# The base: what the Dockerfile uses of python:3.11-slim-bookworm (`python -m venv`, pip's TLS roots).
base_packages=python3,python3-venv,python-is-python3,ca-certificates
base_recipe=(
	mmdebstrap --variant=minbase --format=tar --include="$base_packages"
	# Like the slim images: no manuals, translations or documentation but the copyright files.
	--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*'
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
	"$suite"
)
base_sources=("deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security_mirror $suite-security main")
# The build context, as .dockerignore selects it (keep the two in step).
# build/sandkeep-rmtree: the compiled walker, built on the host first (hack/rmtree.sh; the base has no Go).
context=(Dockerfile .dockerignore pyproject.toml constraints.txt README.md controller build/sandkeep-rmtree)

log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "FAILED: $*"
	exit 1
}
sha() { sha256sum | cut -c1-16; }

context_hash() {
	(
		cd "$repo"
		find "${context[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
	) | sha
}

need_tools() {
	local missing=() pair
	for pair in mmdebstrap:mmdebstrap buildah:buildah; do
		command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
	done
	((${#missing[@]} == 0)) && return
	((EUID == 0)) || die "missing ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
	log "installing ${missing[*]} (apt-get)"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# buildah on the private storage under the cache; overlay where the kernel allows it, else vfs.
driver='' runroot='' home=''
bh() { buildah --root "$cache/storage-$driver" --runroot "$runroot-$driver" --storage-driver "$driver" "$@"; }

pick_driver() {
	local c
	driver=${SANDKEEP_IMAGE_DRIVER:-overlay}
	[[ $driver == vfs ]] && return
	if c=$(bh from scratch 2>/dev/null) && bh mount "$c" >/dev/null 2>&1; then
		bh rm "$c" >/dev/null
		return
	fi
	[[ -n ${c:-} ]] && bh rm "$c" >/dev/null 2>&1
	log "overlay storage does not work here; using vfs (slower, larger)"
	driver=vfs
}

# import_base REF: mmdebstrap the base rootfs (or reuse its tarball) and commit it to buildah's storage as REF.
import_base() {
	local ref=$1 tarball=$cache/base-${1##*:}.tar c
	if [[ ! -s $tarball ]]; then
		log "mmdebstrap $suite base (python3, python3-venv; about 2 minutes)"
		rm -f "$cache"/base-*.tar
		"${base_recipe[@]}" "$tarball.part" "${base_sources[@]}" </dev/null >&2
		mv "$tarball.part" "$tarball"
	fi
	c=$(bh from scratch)
	bh add "$c" "$tarball" / >/dev/null
	bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
		--cmd python3 --label org.opencontainers.image.description="Debian $suite with python3 (mmdebstrap), stands in for python:3.11-slim-$suite" \
		"$c"
	bh commit --rm -q "$c" "$ref" >/dev/null
}

# check REF: run the console script as each of the chart's containers does: read-only root, the
# controller as uid 65532, the agent as root, the image's environment and nothing else.
check() {
	local c mnt env
	c=$(bh from --pull-never "$1")
	mnt=$(bh mount "$c")
	mapfile -t env < <(bh inspect --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$1" | grep .)
	# shellcheck disable=SC2016 # expanded by the inner shell
	unshare --mount --propagation private bash -euo pipefail -c '
		mnt=$1
		shift
		env=("$@")
		mount --bind -o ro "$mnt" "$mnt"
		run() {
			local user=$1
			shift
			chroot --userspec="$user" "$mnt" env -i "${env[@]}" "$@" >/dev/null
		}
		run 65532:65532 sandkeep --version
		run 65532:65532 sandkeep --log-level=INFO controller --help
		run 0:0 sandkeep --log-level=INFO agent --help
		run 0:0 sandkeep --log-level=INFO csi-registrar --help
		# the agent deletes with the compiled walker beside its interpreter, which runs (and refuses no arguments)
		run 0:0 python -c "from controller.node import fsdelete; assert fsdelete.compiled_walker(), fsdelete.COMPILED"
		run 0:0 sh -c "sandkeep-rmtree 2>/dev/null; test \$? -eq 2"
		# kopf names its identity after the user: a uid /etc/passwd does not know stops the controller.
		run 65532:65532 python -c "import getpass; getpass.getuser()"
		run 0:0 python -c "import getpass; getpass.getuser()"
		touch "$mnt/probe" 2>/dev/null && { echo "root is not read-only" >&2; exit 1; }
		exit 0
	' check "$mnt" "${env[@]}" || {
		bh rm "$c" >/dev/null
		die "the image does not run sandkeep as the chart does (above)"
	}
	bh rm "$c" >/dev/null
}

main() {
	((EUID == 0)) || die "needs root (buildah's storage and mmdebstrap's chroot)"
	need_tools
	bash "$repo/hack/protos.sh" || die "hack/protos.sh could not generate controller/csi/proto/ (run \`make venv\` first)"
	bash "$repo/hack/rmtree.sh" "$repo/build/sandkeep-rmtree" || die "hack/rmtree.sh could not build the compiled walker"
	local base_key key version ref archive
	base_key=$(printf '%s\n' "${base_recipe[@]}" "${base_sources[@]}" | sha)
	key=$(printf '%s\n' "$base_key" "$(context_hash)" "$(sha <"${BASH_SOURCE[0]}")" | sha)
	version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")
	ref=localhost/sandkeep:$version-$key
	archive=$cache/sandkeep-$key.tar
	if [[ -s $archive ]]; then
		log "up to date: $archive"
		printf '%s\n%s\n' "$archive" "$ref"
		return
	fi

	mkdir -p "$cache"
	exec 9>"$cache/.lock"
	flock 9
	if [[ -s $archive ]]; then
		log "built meanwhile by another run: $archive"
		printf '%s\n%s\n' "$archive" "$ref"
		return
	fi
	runroot=/run/sandkeep-image-$(printf '%s' "$cache" | sha)
	pick_driver
	local base_ref=localhost/sandkeep-python:$base_key
	bh inspect --type image "$base_ref" >/dev/null 2>&1 || import_base "$base_ref"

	# pip inside the build uses the host's CA bundle and, if the host sets one, its package index (a
	# mirror): a pip.conf and the bundle in a directory mounted as root's home of the RUN steps. /root
	# exists in the base, so no mount point is left in the image (a mount at /etc/pip.conf leaves an
	# empty file in the layer of every RUN step).
	home=$(mktemp -d)
	trap 'rm -rf "$home"' EXIT
	mkdir -p "$home/.config/pip"
	printf '[global]\n' >"$home/.config/pip/pip.conf"
	if [[ -s $ca_bundle ]]; then
		cp "$ca_bundle" "$home/.config/pip/host-ca.crt"
		printf 'cert = /root/.config/pip/host-ca.crt\n' >>"$home/.config/pip/pip.conf"
	fi
	[[ -z ${PIP_INDEX_URL:-} ]] || printf 'index-url = %s\n' "$PIP_INDEX_URL" >>"$home/.config/pip/pip.conf"
	chmod -R go+rX "$home"
	log "buildah bud $ref (from $base_ref)"
	local start=$SECONDS
	if ! bh bud --isolation chroot --pull-never --build-arg "PYTHON_IMAGE=$base_ref" -v "$home:/root:ro" \
		--tag "$ref" --file "$repo/Dockerfile" "$repo" >"$cache/build.log" 2>&1; then
		tail -n 40 "$cache/build.log" >&2
		die "buildah bud failed; the whole output is in $cache/build.log"
	fi
	check "$ref"
	rm -f "$archive.part"
	bh push -q "$ref" "docker-archive:$archive.part:$ref" >&2
	mv "$archive.part" "$archive"
	log "built in $((SECONDS - start))s: $archive ($(du -m "$archive" | cut -f1) MB)"

	# Keep the cache bounded: only this image and its base.
	local old
	for old in "$cache"/sandkeep-*.tar; do
		[[ $old == "$archive" ]] || rm -f "$old"
	done
	while read -r old; do
		[[ $old == "$ref" || $old == "$base_ref" || $old == '<none>:<none>' ]] || bh rmi "$old" >/dev/null
	done < <(bh images --format '{{.Name}}:{{.Tag}}')
	bh rmi --prune >/dev/null
	printf '%s\n%s\n' "$archive" "$ref"
}

main "$@"
