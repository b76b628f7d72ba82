// Package maps is typed access to rlagent's BPF objects: it loads the data
// path (bpf/), optionally pins its maps under a directory, and is the only
// package that reads or writes an *ebpf.Map.
//
// The data path's programs share the maps: Program is the XDP program and
// TCProgram(h) the TC program of hook h (an attach point, Uplink or
// Endpoints, and a direction). Each enforces the limits of its own hook;
// a limit's Match.Attach and Match.Direction name its one hook. Attaching
// them is for the caller (the attach package).
//
// A Datapath holds one loaded collection. Limits are written with SetLimit
// and removed with DeleteLimit; each call validates its input first and
// writes nothing when it is invalid. SetLimit on an existing limit changes
// its rate and burst in place: the refill rate changes from the moment of the
// write and every bucket keeps its tokens, clamped to the new burst.
//
// The classifier (which packets a limit sees) is derived from all limits at
// once and written as a diff, so a change touches only the entries it
// changes. The limit is the last thing written when it is added and the first
// thing disabled when it is removed, so a packet never sees a limit half-set.
//
// A Datapath is safe for use by one goroutine at a time; Close releases the
// file descriptors but leaves pinned maps in place.
package maps
