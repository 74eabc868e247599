//go:build race

package conformance

// raceEnabled: the race runtime's exit hook (racefini) has crashed in
// peers whose native engine still runs threads at exit, so peers leave
// with syscall.Exit under -race.
const raceEnabled = true
