"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): multi-head latent attention whose queries
attend only to the keys a lightning indexer picks. Plugins reach it through :mod:`mcore_zoo.plugin_api`."""
