// Package divide is the Divide of Watch -> Divide -> Enforce: it turns a
// global limit (a rate and a burst) and the count it is divided by into
// one replica's share, and a demand allocation's rate into a share with a
// burst to match.
//
// It is pure arithmetic: no clock, no I/O, and no import of the data path
// (maps, attach, cilium/ebpf). The node agent divides what it writes into
// the kernel's maps with it; a process that enforces the same limits per
// request divides with it too, so both enforcement points agree on every
// share.
package divide
