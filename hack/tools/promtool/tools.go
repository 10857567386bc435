//go:build tools

// Package tools pins promtool, which checks and unit-tests the chart's alerting rules, and the
// Prometheus server the end-to-end suite scrapes the chart's Pods with.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
