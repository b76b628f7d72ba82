// Package count holds the replica count sources that need no cluster,
// and the two types every source shares.
//
// A Source reports, per limit, the latest Observation: how many replicas
// share the limit (and, for the service scope, how many of them are here),
// when that was last confirmed, and the last error reading it. The last
// good observation is state, not a cache entry: an error, a timeout or a
// missing file never resets a count. Only its age grows, and callers
// report that age.
//
// Static is a fixed count; File is one integer in a file, polled. The
// cluster's source, watcher.Kubernetes, is in the parent package, so that
// what imports only these (the limiter library without Kubernetes) does
// not import client-go. Package watcher re-exports them under their old
// names.
package count
