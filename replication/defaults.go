package replication

import "time"

// Defaults that New applies to a zero (or, for MonitorInterval, unset)
// Config field. cmd/jetbox uses the same constants as its flag defaults, so
// each value has one source.
const (
	// DefaultStatusInterval is how often standby status is sent
	// (Config.StatusInterval, --status-interval).
	DefaultStatusInterval = time.Second
	// DefaultTimeout is how long Postgres may send nothing before jetbox
	// reconnects (Config.Timeout, --postgres-timeout).
	DefaultTimeout = 30 * time.Second
	// DefaultShutdownTimeout bounds the wait for in-flight acks on a stop
	// (Config.ShutdownTimeout, --shutdown-timeout).
	DefaultShutdownTimeout = 10 * time.Second
	// DefaultMaxBackoff is the longest wait between reconnects
	// (Config.MaxBackoff; no flag).
	DefaultMaxBackoff = 30 * time.Second
	// DefaultStandbyRetry is how often a standby retries the slot
	// (Config.StandbyRetry, --standby-retry).
	DefaultStandbyRetry = time.Second
	// DefaultMonitorInterval is how often the slot's lag and retained WAL are
	// read (Config.MonitorInterval, --monitor-interval).
	DefaultMonitorInterval = 5 * time.Second
)
