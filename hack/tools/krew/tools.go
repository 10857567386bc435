//go:build tools

// Package tools pins krew, the kubectl plugin manager that tests/apiserver/test_krew.py installs the
// `kubectl sandkeep` plugin with, from the manifest and archive that `make release` writes.
package tools

import _ "sigs.k8s.io/krew/cmd/krew"
