package limiter

import (
	"errors"
	"fmt"
	"time"
)

// ErrLimited is what every refusal of a limit matches (errors.Is).
var ErrLimited = errors.New("rate limited")

// RejectedError is Wait's error when a limit refuses a draw: it drew
// nothing from any limit of the Set.
type RejectedError struct {
	// Limit is the first limit of the Set that refused.
	Limit string
	// RetryAfter is when the same draw could succeed, if nothing else
	// draws first; 0 if it never can (more tokens than the burst).
	RetryAfter time.Duration
}

func (e *RejectedError) Error() string {
	if e.RetryAfter <= 0 {
		return fmt.Sprintf("limit %q: %v", e.Limit, ErrLimited)
	}
	return fmt.Sprintf("limit %q: %v, retry after %v", e.Limit, ErrLimited, e.RetryAfter)
}

// Is makes a RejectedError match ErrLimited.
func (e *RejectedError) Is(target error) bool { return target == ErrLimited }
