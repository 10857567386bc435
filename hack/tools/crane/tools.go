//go:build tools

// Package tools pins crane (go-containerregistry), which `make release` pushes the image's archive to a
// registry with.
package tools

import _ "github.com/google/go-containerregistry/cmd/crane"
