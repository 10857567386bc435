//go:build tools

// Package tools pins CNCF Distribution's registry, the OCI registry the end-to-end bed and `make release`
// push the image and the chart to.
package tools

import _ "github.com/distribution/distribution/v3/cmd/registry"
