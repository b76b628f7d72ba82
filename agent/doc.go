// Package agent is rlagent's node agent: it reconciles the configured
// limits and the observed replica counts into the data path's maps.
//
// Desired state is limits x counts -> shares -> map entries (Divide). The
// reconcile gathers what it decides from (the limits, their counts, this
// node's endpoints, the demand shares, the ids given out), plans from that
// data alone (plan: pure, no lock, no I/O, tested as tables without root)
// and applies the plan to the data path. It is idempotent and writes only
// what changed. A new config file
// is validated whole before any of it is applied; an invalid one is
// rejected and the previous limits keep being enforced. Within a valid
// config each limit is installed alone: one that does not fit the data path
// is reported and skipped (or clamped to its range), and the others keep
// following their counts.
//
// The agent owns attach and detach, the pins and the protect rules (the
// node's lifeline, which no limit touches). Maps and XDP links are pinned
// under the pin directory, so when the agent exits, however it exits, the
// kernel keeps enforcing the last shares; the next agent adopts the pins
// (replacing the program in the pinned links in one atomic update) and
// reconciles from there. One agent holds a pin directory at a time (a flock
// on it, with the holder's record beside); a pin directory that could not
// outlive the agent is refused. Cleanup removes the pins. Readers (status)
// open the pins read-only and never write.
package agent
