//go:build tools

// Package tools pins Prometheus and promtool. promtool checks the chart's alert rules as Prometheus would load
// them; the server scrapes the product on the real node, so the dashboard's and the alerts' queries meet real series.
// In a wrapper module of its own: Prometheus' module graph (every service discovery's cloud SDK) is far larger
// than the control plane's, and a Prometheus bump must not change its cache keys.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
