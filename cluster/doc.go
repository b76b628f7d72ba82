// Package cluster is what an agent writes to the Kubernetes cluster, as
// watcher/ is what it reads:
//
//   - the RateLimit status (StatusWriter): written by one agent, elected
//     with the Lease rlagent-status; the count each limit is divided by,
//     its Accepted condition from the nodes' verdicts, and each
//     demand-shared limit's allocation (the policy of a round is
//     demand.Round's; the writer reads the Leases and keeps the rounds);
//   - each node's own Lease, rlagent-demand-NODE (DemandPublisher and
//     Reporter): its demands, at most once an interval and only when they
//     moved, and its verdicts on the limits it could not apply plainly;
//   - Events on the RateLimits, for people (Reporter).
//
// It calls nothing in the agent: the agent gives it what it needs
// (StatusWriter.Configure, Reporter.Report, DemandPublisher.Publish).
package cluster
