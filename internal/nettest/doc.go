// Package nettest builds small networks for end-to-end tests and the demo:
// network namespaces joined by a veth pair, UDP sockets inside them, a paced
// UDP sender that stops by itself, and a receiver that counts packets per
// time bin.
//
// Everything here is done with netlink and setns from Go, never with
// external commands (ip, nsenter), so that the same tests run inside a
// minimal VM whose /init is a static Go program. The one exception: a
// Topology with a Service runs the nft binary (package nftables, installed
// by make deps-test) inside its node namespace for the DNAT rules; those
// tests stay on the host.
//
// Lifetimes. A namespace lives while its handle (NS), a socket opened in it,
// or a process running in it lives: the namespaces are not named (nothing in
// /var/run/netns), so a crashed test leaves none behind. Close (or the
// t.Cleanup that MustPair registers) closes the handles; the kernel deletes
// the namespace, and the veth pair with it, once its last user is gone.
//
// Running a program in a namespace. NS.Start starts an *exec.Cmd as a
// re-execution of the current binary, a launcher: MaybeExec, called first
// thing in TestMain or main, enters the namespace on a locked OS thread and
// execve's the program, which keeps that thread's network namespace. The
// process so started is the program itself, with its own PID.
package nettest
