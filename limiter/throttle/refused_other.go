//go:build !windows

package throttle

import (
	"errors"
	"syscall"
)

// isRefused reports whether err, a dial's cause, is a refused or reset
// connection.
func isRefused(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET)
}
