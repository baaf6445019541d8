package replication

// States of a Streamer (Streamer.State), exported one-hot as
// jetbox_state{state=...}.
const (
	StateStarting     = "starting"
	StateStreaming    = "streaming"
	StateStandby      = "standby"      // another instance holds the slot
	StateReconnecting = "reconnecting" // between replication sessions
	StateRepublishing = "republishing" // publishes failed; retrying in order
	StateRepairing    = "repairing"    // jetbox run repairs a lost slot (--on-lost-slot=repair)
	StateStopped      = "stopped"
)

// States returns every state a Streamer can be in.
func States() []string {
	return []string{StateStarting, StateStreaming, StateStandby, StateReconnecting, StateRepublishing, StateRepairing, StateStopped}
}
