package watcher

import "github.com/rlagent/rlagent/watcher/count"

// The count sources that need no cluster live in package count (which
// imports nothing of client-go); these are their names here.
type (
	Observation = count.Observation
	Source      = count.Source
	Static      = count.Static
	File        = count.File
)

// NewStatic returns a source that always reports n replicas.
func NewStatic(n int) *Static { return count.NewStatic(n) }

// NewFile returns a source that reads a count from path every interval
// (0: count.DefaultPollInterval).
var NewFile = count.NewFile

// Errors of a count file; see package count.
var (
	ErrEmpty      = count.ErrEmpty
	ErrNotRegular = count.ErrNotRegular
)
