// Package throttle is client-side adaptive throttling, as Google's SRE book
// describes it in "Handling Overload": a client that sees its backend
// refuse requests starts refusing some of them itself, before they leave,
// with probability
//
//	max(0, (requests - K×accepts) / (requests + 1))
//
// where requests and accepts are counted over a sliding window (2 minutes
// by default). While the backend accepts everything, the probability is 0.
// When it accepts only some, the client lets through about K times what
// the backend accepts and refuses the rest locally, so the backend spends
// no work on requests it would refuse anyway; the K-1 extra accepts' worth
// is how the client finds out, soon, that the backend has recovered.
//
// # What it owns
//
// A [Throttle] owns its two counters and nothing else: it does not know
// what a request is. The caller asks [Throttle.Allow] before sending and
// tells [Throttle.Record] how the backend answered. [Transport] does that
// for net/http; the gRPC interceptors are in package grpclimit.
//
// # What is counted
//
//   - A request Allow refuses counts as a request, not an accept (the
//     book's rule: the refusals keep the probability up while the overload
//     lasts).
//   - A request that went out counts when it is recorded: Record(true)
//     counts a request and an accept, Record(false) a request only.
//   - A request that went out but is never recorded (the caller gave up,
//     the outcome says nothing of the backend) does not count at all.
//
// A rejection is the backend saying it will not do the work: for HTTP a
// 429 or a 503 response, or a connection refused or reset while connecting
// (what rlagent's kernel `action: reject` answers to a SYN). Any other
// response is an accept, errors included: the backend did the work, or
// tried to. See [Classify].
//
// # Window
//
// The window is a ring of 32 buckets; a call touches the current bucket
// and, when time has moved on, clears the buckets that left the window, so
// a call costs O(1) (amortized: an idle throttle clears at most 33
// buckets on its next call). The oldest bucket is weighed by the part of
// it still inside the window, so the counts slide smoothly rather than by
// a bucket at a time.
//
// # Lifetime and concurrency
//
// A Throttle is safe for concurrent use; it holds one mutex for a few
// dozen nanoseconds a call, and a call allocates nothing. It has no
// goroutine and nothing to close. Share one Throttle per backend (or per
// backend and method, if they fail independently).
package throttle
