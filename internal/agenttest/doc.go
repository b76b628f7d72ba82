// Package agenttest runs the rlagent binary under test for the end-to-end
// (test/e2e) and Kubernetes (test/k8s) tests: it builds the binary once per
// test binary (or takes $RLAGENT_BIN), starts `rlagent run` in a network
// namespace and stops that process only, by its PID, mounts a private BPF
// filesystem for its pins, and reads `rlagent status --output json`.
//
// Lifetimes. Everything a helper starts or mounts is undone in the test's
// Cleanup, which runs also when the test fails: Start stops the agent
// (SIGTERM, then SIGKILL after 5 s) and prints its output on failure;
// PinDir runs `rlagent cleanup` on pins an agent left attached and
// unmounts the filesystem.
//
// Only tests import this package.
package agenttest
