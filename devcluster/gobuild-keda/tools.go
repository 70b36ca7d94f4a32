//go:build tools

// Package tools pins KEDA's operator and metrics adapter, which the cluster tests run beside the control plane to
// drive a role's /scale from the planner's metric. In a wrapper module of its own: KEDA's module graph (every
// scaler's cloud SDK) is far larger than the control plane's, and a KEDA bump must not change its cache keys.
package tools

import (
	_ "github.com/kedacore/keda/v2/cmd/adapter"
	_ "github.com/kedacore/keda/v2/cmd/operator"
)
