//go:build tools

// Package tools pins the etcd server sandkeep's local control plane stores its state in.
package tools

import _ "go.etcd.io/etcd/server/v3"
