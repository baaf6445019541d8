package main

import (
	"reflect"
	"regexp"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
)

var tagVar = regexp.MustCompile(`\$\{([^}]*)\}`)

// TestFlagDefaults: every ${var} in a flag tag is defined, and the defaults
// the flags render are the constants the packages apply to a zero Config,
// so a default has one source and changing it changes both.
func TestFlagDefaults(t *testing.T) {
	used := map[string]bool{}
	var walk func(rt reflect.Type)
	walk = func(rt reflect.Type) {
		for i := 0; i < rt.NumField(); i++ {
			f := rt.Field(i)
			for _, m := range tagVar.FindAllStringSubmatch(string(f.Tag), -1) {
				used[m[1]] = true
				if m[1] == "default" {
					continue // kong's own: the flag's default, in its help
				}
				if _, ok := flagVars[m[1]]; !ok {
					t.Errorf("%s.%s: tag uses ${%s}, which flagVars does not define", rt.Name(), f.Name, m[1])
				}
			}
			if f.Type.Kind() == reflect.Struct {
				walk(f.Type)
			}
		}
	}
	walk(reflect.TypeOf(cli{}))
	for v := range flagVars {
		if !used[v] {
			t.Errorf("flagVars defines %s, which no flag tag uses", v)
		}
	}

	var f RunFlags
	parseDefaults(t, &f)
	f.PostgresURL = "postgres://u@127.0.0.1/db"
	cfg, err := f.Config()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []struct {
		what      string
		got, want any
	}{
		{"--publish-timeout", cfg.Sink.PublishTimeout, sink.DefaultPublishTimeout},
		{"--max-in-flight (sink)", cfg.Sink.MaxPending, sink.DefaultMaxPending},
		{"--max-in-flight (replication)", cfg.Replication.MaxInFlight, sink.DefaultMaxPending},
		{"--duplicate-window", cfg.Sink.DuplicateWindow, sink.DuplicateWindowFor(true, sink.DefaultPublishTimeout, 10*time.Minute)},
		{"--stream-replicas (auto)", cfg.Sink.StreamSpec.Replicas, 0},
		{"--stream-max-bytes", cfg.Sink.StreamSpec.MaxBytes, int64(-1)},
		{"--stream-max-msgs", cfg.Sink.StreamSpec.MaxMsgs, int64(-1)},
		{"no stream setting given", len(cfg.Sink.StreamSpec.Given), 0},
		{"--status-interval", cfg.Replication.StatusInterval, replication.DefaultStatusInterval},
		{"--postgres-timeout", cfg.Replication.Timeout, replication.DefaultTimeout},
		{"--shutdown-timeout", cfg.Replication.ShutdownTimeout, replication.DefaultShutdownTimeout},
		{"--standby-retry", cfg.Replication.StandbyRetry, replication.DefaultStandbyRetry},
		{"--monitor-interval", cfg.Replication.MonitorInterval, replication.DefaultMonitorInterval},
		{"--standby-slot-timeout", cfg.Replication.StandbySlots.Timeout, replication.DefaultStandbySlotTimeout},
		{"--on-standby-slot-timeout", cfg.Replication.StandbySlots.OnTimeout, replication.StandbySlotWait},
		{"the column flags", cfg.Replication.Decoder.Columns, decoder.DefaultColumns},
		{"--delivery", cfg.Sink.Delivery.ExactlyOnce(), DefaultDelivery == "exactly-once"},
	} {
		if d.got != d.want {
			t.Errorf("%s defaults to %v, the package constant is %v", d.what, d.got, d.want)
		}
	}

	for d, want := range map[time.Duration]string{time.Second: "1s", 2 * time.Minute: "2m", 90 * time.Second: "1m30s",
		time.Hour: "1h", 90 * time.Minute: "1h30m", 500 * time.Millisecond: "500ms"} {
		if got := durationText(d); got != want {
			t.Errorf("durationText(%v) = %q, want %q", d, got, want)
		}
	}
}
