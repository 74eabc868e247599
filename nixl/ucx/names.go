package ucx

// EngineName is the registry key of this engine.
const EngineName = "ucx"

// Environment variables read by this package.
const (
	// EnvLib names the libucp to load, overriding the search.
	EnvLib = "GONIXL_UCX_LIB"
	// EnvErrMode sets the endpoint error-handling mode ("auto", "peer" or
	// "none") when the backend parameters do not.
	EnvErrMode = "GONIXL_UCX_ERR_MODE"
)
