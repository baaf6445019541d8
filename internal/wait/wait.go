// Package wait holds the one way jetbox pauses: a sleep that ends early
// when its context does.
package wait

import (
	"context"
	"time"
)

// Sleep waits d, or until ctx ends (its error).
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
