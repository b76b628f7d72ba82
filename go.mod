module github.com/rlagent/rlagent

go 1.26.0

require (
	github.com/cilium/ebpf v0.22.0
	golang.org/x/sys v0.50.0
)

require golang.org/x/time v0.16.0 // indirect

tool github.com/cilium/ebpf/cmd/bpf2go
