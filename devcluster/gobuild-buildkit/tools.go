//go:build tools

// Package tools pins BuildKit's daemon and client. BuildKit's go.mod has exclude directives, which
// `go install pkg@version` refuses, so it builds inside this wrapper module of its own (apart from the control
// plane's, so a BuildKit bump never changes the control plane's cache keys).
package tools

import (
	_ "github.com/moby/buildkit/cmd/buildctl"
	_ "github.com/moby/buildkit/cmd/buildkitd"
)
