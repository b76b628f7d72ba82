// Package agent is rlagent's node agent: it reconciles the configured
// limits and the observed replica counts into the data path's maps.
//
// Desired state is limits x counts -> shares -> map entries (Divide). The
// reconciler is idempotent and writes only what changed. A new config is
// validated whole before any of it is applied; an invalid one is rejected
// and the previous limits keep being enforced.
//
// The agent owns attach and detach and the pins. Maps and XDP links are
// pinned under the pin directory, so when the agent exits, however it exits,
// the kernel keeps enforcing the last shares; the next agent adopts the pins
// (replacing the program in the pinned links in one atomic update) and
// reconciles from there. Cleanup removes them.
package agent
