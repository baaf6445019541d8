//go:build race

package main

// raceEnabled: this test binary runs with the race detector, so TestMain
// builds the jetbox binary under test with it too.
const raceEnabled = true
