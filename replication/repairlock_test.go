package replication

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// TestRepairLockCheck: the lock's check passes while it is held, and fails
// once its session is gone (here terminated, as idle_session_timeout or a
// cut the server's keepalives end would), when another process can take
// the lock: a repair fenced by it publishes no more.
func TestRepairLockCheck(t *testing.T) {
	pg := testenv.StartPostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	lock, err := LockRepair(ctx, pg.DSN, "jetbox")
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Release(ctx)
	if err := lock.Check(ctx); err != nil {
		t.Fatalf("check of a held lock: %v", err)
	}
	if _, err := LockRepair(ctx, pg.DSN, "jetbox"); !errors.Is(err, ErrRepairBusy) {
		t.Fatalf("second LockRepair: %v, want ErrRepairBusy", err)
	}
	pg.Exec(t, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'jetbox repair lock'")
	var other *RepairLock
	testenv.WaitFor(t, 30*time.Second, func() error {
		other, err = LockRepair(ctx, pg.DSN, "jetbox")
		return err
	})
	defer other.Release(ctx)
	if err := lock.Check(ctx); err == nil {
		t.Fatal("the check passed after the lock's session was terminated and another process took it")
	}
}
