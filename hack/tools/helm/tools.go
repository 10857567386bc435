//go:build tools

// Package tools pins the helm CLI the chart is rendered, linted and installed with.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
