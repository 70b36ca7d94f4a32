//go:build tools

// Package tools pins promtool, which the tests run to check the chart's alert rules as Prometheus would load them.
// In a wrapper module of its own: Prometheus' module graph (every service discovery's cloud SDK) is far larger
// than the control plane's, and a Prometheus bump must not change its cache keys.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
