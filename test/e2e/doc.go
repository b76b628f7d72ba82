// Package e2e holds rlagent's end-to-end tests: the real rlagent binary,
// attached to one end of a veth pair between two network namespaces the test
// creates, limiting real UDP packets sent by a bounded, paced Go sender.
//
// The tests use no external command, so that test/vmtests can run this
// package's test binary unchanged inside a VM whose /init is a static Go
// program. The binary under test is built once by TestMain from
// ./cmd/rlagent, or taken from $RLAGENT_BIN when that is set (the VM has no
// Go toolchain). $RLAGENT_E2E_GLOBAL_RATE scales the traffic down for a slow
// machine (default 8000 pkt/s global; the sender offers up to 16,000). The
// agent runs in its namespace through the test binary
// re-executed as a launcher (nettest.MaybeExec), so each test knows the
// agent's PID and stops that process only.
//
// The privileged tests need root and skip without it (fail with
// RLAGENT_REQUIRE_ROOT_TESTS=1). They run one after another: the rates they
// measure need the machine's two CPUs.
package e2e
