package sink

import "time"

// Defaults that New applies to a zero Config field. cmd/jetbox uses the same
// constants as its flag defaults, so each value has one source.
const (
	// DefaultPublishTimeout is how long one PubAck is waited for before the
	// outcome counts as unknown (Config.PublishTimeout, --publish-timeout).
	DefaultPublishTimeout = 30 * time.Second
	// DefaultMaxPending is the window of async publishes in flight
	// (Config.MaxPending). It is also --max-in-flight's default, the window
	// of the replication loop's tracker, which the sink's follows.
	DefaultMaxPending = 1024
	// DefaultDuplicateWindow is the duplicate window of a stream jetbox
	// creates (Config.DuplicateWindow, --duplicate-window): JetStream's own
	// default.
	DefaultDuplicateWindow = 2 * time.Minute
)
