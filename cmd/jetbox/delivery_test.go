package main

import (
	"testing"

	"github.com/jetbox-dev/jetbox/sink"
)

// TestDeliveryFlags: --delivery, --order-guard and --atomic-transactions
// select one of the four delivery modes, which reaches the sink and the
// decoder (atomic transactions).
func TestDeliveryFlags(t *testing.T) {
	for _, c := range []struct {
		delivery, guard, atomic string
		want                    sink.Delivery
	}{
		{"exactly-once", "true", "false", sink.ExactlyOnce},
		{"exactly-once", "true", "true", sink.ExactlyOnceAtomic},
		{"dedup", "true", "false", sink.DedupGuarded},
		{"dedup", "false", "false", sink.Dedup},
	} {
		var f RunFlags
		parseDefaults(t, &f)
		f.PostgresURL = "postgres://u@127.0.0.1/db"
		f.Delivery = c.delivery
		f.OrderGuard.set(c.guard)
		f.AtomicTx.set(c.atomic)
		cfg, err := f.Config()
		if err != nil {
			t.Fatalf("%+v: %v", c, err)
		}
		if got := cfg.Sink.Delivery; got != c.want || cfg.Replication.Decoder.Atomic != c.want.Atomic() {
			t.Errorf("--delivery=%s --order-guard=%s --atomic-transactions=%s: %v (decoder atomic %v), want %v",
				c.delivery, c.guard, c.atomic, got, cfg.Replication.Decoder.Atomic, c.want)
		}
	}
}
