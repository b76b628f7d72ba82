package throttle

import (
	"errors"
	"syscall"
)

// Windows reports a refused connect as WSAECONNREFUSED, or from ConnectEx
// as ERROR_CONNECTION_REFUSED; syscall.ECONNREFUSED is an invented Errno
// that Windows never returns, and Errno.Is does not map them.
const (
	errorConnectionRefused syscall.Errno = 1225  // ERROR_CONNECTION_REFUSED
	wsaeconnrefused        syscall.Errno = 10061 // WSAECONNREFUSED
)

// isRefused reports whether err, a dial's cause, is a refused or reset
// connection.
func isRefused(err error) bool {
	return errors.Is(err, wsaeconnrefused) || errors.Is(err, errorConnectionRefused) ||
		errors.Is(err, syscall.WSAECONNRESET) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET)
}
